"""Errors the CLI turns into exit code 2 with a one-line reason."""


class BadInput(ValueError):
    """User input that cannot run: unknown model, invalid layout, corrupt baseline, missing dependency."""


class MissingDependency(BadInput):
    """An engine or path needs a package that is not installed; the message names the install command."""


class DoesNotApply(BadInput):
    """The selection asks a path or a suite for what it does not do: a model or layout the engine cannot build, a
    suite whose contract is not the engine's. Refused before any rank starts; a nightly records the pair as not
    applicable, not as a failure."""


class NotOnThisStack(DoesNotApply):
    """A construction path the installed releases cannot run together (an upstream defect: mbridge 0.15.1 on
    megatron-core >= 0.18). Named explicitly it is refused before any rank starts (exit 2); in a default matrix or
    a nightly its runs are skipped with the reason, naming the regression that goes unjudged on that path."""


class DoesNotFit(BadInput):
    """The training-memory model predicts a case will not fit the memory it would run in; the message names the
    predicted and available GiB and the nearest setting that fits. Refused before any rank starts."""


class Interrupted(BaseException):
    """The run was asked to stop (SIGTERM from CI, Ctrl-C): finished results are kept, the exit code is
    128 + the signal (143 for SIGTERM, 130 for SIGINT)."""

    def __init__(self, signum: int):
        import signal

        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum
