"""A suite's cases as the user selected them (`CaseSelection`): read once from the case-selection flags
(`commands/case_args.add_case_args`, `CaseSelection.from_args`), turned back into command-line arguments for a
step or a round in another process (`to_argv`, `variant_argv`), and handed to `driver.plan`."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

from harness.backends import BACKENDS, Backend
from harness.engine_names import EngineName
from harness.errors import BadInput
from harness.option_flags import ParamFlag, flags_of
from harness.platform import resolve_backend
from harness.spec import Case, CaseOptions, id_fragment
from harness.suite_flags import check_param_values, param_flags, variant_flags
from harness.suite_registry import default_dtype


def option_flags() -> list[ParamFlag]:
    """The core training options' flags, as CaseOptions' fields declare them."""
    return flags_of([CaseOptions])


# (flag, field, argparse destination) of each
OPTION_FLAGS = tuple((pf.flag, pf.field, pf.dest) for pf in option_flags())
OPTION_DEFAULTS = CaseOptions()
DEFAULT_WORLD_SIZE = 4
# The selection's flags that the CLI and the pytest options of suites/ (suites/conftest.py) share, declared here
# once: flag -> argparse / pytest keywords.
SHARED_FLAGS: dict[str, dict] = {
    "--model": dict(default=None, help="model spec (default: the suite's CPU model, tiny or small)"),
    "--world-size": dict(type=int, default=DEFAULT_WORLD_SIZE,
                         help=f"ranks per case (default {DEFAULT_WORLD_SIZE})"),
    "--engine": dict(default=EngineName.MCORE, help="mcore, or a user engine package.module:factory"),
    "--backend": dict(default=Backend.AUTO, choices=BACKENDS,
                      help="auto: nccl where every rank has a GPU of its own, else gloo (ranks on CPU)"),
}

# --timeout, declared once (the case-selecting commands, torchrun): how long a case may run. The local runner ends
# its ranks then; under torchrun, whose processes outlive a case, a collective hung that long raises.
TIMEOUT_FLAG: dict = dict(type=float, default=None, help="per-case timeout in seconds (default 300; under torchrun "
                                                         "the process group's: a collective hung that long raises)")


def variant_argv(variant: str) -> list[str]:
    """The flags that select a case's variant again (`Case.variant`, e.g. 'use_distributed_optimizer=True,
    ckpt_format=dp_reshardable'); fields without a flag are the suite's own settings, which it plans again."""
    flags = {**{name: flag for flag, name, _ in OPTION_FLAGS}, **variant_flags()}
    out: list[str] = []
    for part in filter(None, variant.split(",")):
        name, _, value = part.partition("=")
        flag = flags.get(name)
        if flag is None or value == "False":
            continue
        out += [flag] if value == "True" else [flag, value]
    return out


def parse_case_id(case_id: str) -> dict[str, str]:
    """suite / engine / model / layout / variant of a case id `suite/engine/model/layout[variant]`."""
    import re

    suite, engine, model, rest = case_id.split("/", 3)
    m = re.fullmatch(r"([^\[]*)(?:\[(.*)\])?", rest)
    if m is None:  # the pattern matches any string; for the type checker
        raise ValueError(f"not a case id: {case_id!r}")
    return {"suite": suite, "engine": engine, "model": model, "layout": m.group(1), "variant": m.group(2) or ""}


def case_argv(case_id: str, world_size: int | None) -> list[str]:
    """The selection flags that run one case again, from its id alone (a results file's or the history's)."""
    sel = parse_case_id(case_id)
    return ["--suite", sel["suite"], "--model", sel["model"],
            *(["--world-size", str(world_size)] if world_size else []), "--layout", sel["layout"],
            *variant_argv(sel["variant"]), "--engine", sel["engine"]]


@dataclass(frozen=True)
class CaseSelection:
    """A suite's cases as the user selected them. `suite_params` holds only the per-suite parameters the
    user gave (keys are field names of the suite's parameter type)."""

    suite: str
    model: str | None = None  # None: the suite's default model
    world_size: int = DEFAULT_WORLD_SIZE
    layouts: tuple[str, ...] = ()  # (): the suite's matrix
    engine: str = EngineName.MCORE
    backend: Backend = Backend.AUTO
    options: CaseOptions = field(default_factory=CaseOptions)  # steps, seed, dtype, distributed optimizer, overlap
    timeout: float | None = None  # per-case seconds; None: the case's default
    suite_params: dict = field(default_factory=dict)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> CaseSelection:
        """From parsed `add_case_args` flags; BadInput for a value out of range (before anything runs).
        compare's --engine (a list, A then B) selects its first engine here."""
        if args.steps is not None and args.steps < 1:
            raise BadInput(f"--steps must be >= 1, got {args.steps}")
        if args.seed is not None and args.seed < 0:
            raise BadInput(f"--seed must be >= 0, got {args.seed}")
        if args.micro_batch_size is not None and args.micro_batch_size < 1:
            raise BadInput(f"--micro-batch-size must be >= 1, got {args.micro_batch_size}")
        if args.timeout is not None and not args.timeout > 0:
            raise BadInput(f"--timeout must be > 0 seconds, got {args.timeout}")
        params: dict = {}
        for pf in param_flags():
            value = getattr(args, pf.dest)
            if value is not None and value is not False:
                params[pf.field] = tuple(value) if pf.kind == "list" else value
        check_param_values(params)
        engine = args.engine or EngineName.MCORE
        if isinstance(engine, list):  # compare: A then B
            engine = engine[0]
        given = {name: getattr(args, dest) for _, name, dest in OPTION_FLAGS}
        given = {name: v for name, v in given.items() if v is not None}  # not given: the field's default
        if "dtype" not in given:  # the suite's for the backend (GPU ranks: step-perf in bf16)
            given["dtype"] = default_dtype(args.suite, resolve_backend(args.backend, args.world_size))
        options = CaseOptions(**given)
        return cls(suite=args.suite, model=args.model, world_size=args.world_size, layouts=tuple(args.layout or ()),
                   engine=engine, backend=Backend(args.backend), options=options, timeout=args.timeout,
                   suite_params=params)

    def to_argv(self, skip: tuple[str, ...] = ()) -> list[str]:
        """The flags that reproduce this selection (non-defaults only; --suite always). `skip`: flags left
        out, by argparse destination (e.g. "engine", "timed_steps", "layout")."""
        flags = param_flags()
        unknown = set(self.suite_params) - {pf.field for pf in flags}
        if unknown:
            raise ValueError(f"suite parameters without a flag: {sorted(unknown)}")
        flagless = [f.name for f in dataclasses.fields(CaseOptions) if getattr(self.options, f.name) != f.default
                    and f.name not in {name for _, name, _ in OPTION_FLAGS}]
        if flagless:
            raise ValueError(f"options without a flag: {flagless}")
        out: list[str] = []

        def add(dest: str, flag: str, value, default=None) -> None:
            if dest in skip or value is None or value == default or value is False:
                return
            if value is True:
                out.append(flag)
            elif isinstance(value, (list, tuple)):
                out.extend(x for v in value for x in (flag, str(v)))
            else:
                out.extend([flag, str(value)])

        add("suite", "--suite", self.suite)
        add("model", "--model", self.model)
        add("world_size", "--world-size", self.world_size, SHARED_FLAGS["--world-size"]["default"])
        add("layout", "--layout", self.layouts, ())
        add("engine", "--engine", self.engine, SHARED_FLAGS["--engine"]["default"])
        add("backend", "--backend", self.backend, SHARED_FLAGS["--backend"]["default"])

        backend = self.backend if self.backend != Backend.AUTO else resolve_backend(self.backend, self.world_size)
        defaults = {**vars(OPTION_DEFAULTS), "dtype": default_dtype(self.suite, backend)}
        for flag, name, dest in OPTION_FLAGS:
            add(dest, flag, getattr(self.options, name), defaults[name])
        add("timeout", "--timeout", self.timeout)
        for pf in flags:
            add(pf.dest, pf.flag, self.suite_params.get(pf.field))
        return out

    def record_command(self, skip: tuple[str, ...] = (), extra: list[str] | None = None) -> str:
        """`harness baselines record` of this selection (its world size named even where it is the default),
        then extra flags (a case's suite parameters)."""
        import shlex

        argv = ["harness", "baselines", "record", *self.to_argv(skip), *(extra or [])]
        if "--world-size" not in argv:
            at = argv.index("--model") + 2 if "--model" in argv else argv.index("--suite") + 2
            argv[at:at] = ["--world-size", str(self.world_size)]
        return " ".join(shlex.quote(a) for a in argv)

    @property
    def layout_ids(self) -> list[str] | None:
        return list(self.layouts) or None


def bisect_command(case: Case, package: str, before: str, after: str) -> str:
    """`harness bisect` over a package's releases from `before` to `after` (oldest first either way round), judging
    this case: bad where it does not pass (--metric fail); --find-fix where the later release is the earlier one's
    fix, i.e. where the releases go backwards (a baseline recorded on a newer release)."""
    import shlex

    from packaging.version import Version

    options = CaseOptions(**{name: getattr(case.options, name) for _, name, _ in OPTION_FLAGS})
    sel = CaseSelection(case.suite, case.model.name, case.layout.world_size, (case.layout.id,), case.engine,
                        case.backend, options)
    lo, hi = sorted((before, after), key=Version)
    argv = ["harness", "bisect", *(["--megatron-core"] if package == "megatron-core" else ["--package", package]),
            f"{lo}..{hi}", *sel.to_argv(), *variant_argv(id_fragment(case.params)), "--metric", "fail"]
    if Version(after) < Version(before):
        argv.append("--find-fix")
    return shlex.join(argv)


def record_command(case: Case, *, layout: bool = True, world_size: int | None = None, params: bool = True,
                   skip: tuple[str, ...] = ()) -> str:
    """The command that records this case's baseline entry, from the case itself: its model, world size, layout,
    engine, backend (named: on a GPU node `auto` could pick another platform), the options a flag sets (dtype,
    steps, micro-batch size, distributed optimizer, recompute, ...) and its suite parameters (checkpoint format,
    ...). layout=False: the suite records the entry from its whole matrix (golden's one trajectory, a checkpoint
    contract); world_size: the run's where it differs from the case's layout (a contract's half-DP load); params=False:
    without the suite parameters (a contract comes with the default formats); skip: flags the suite sets itself
    (to_argv's destinations, e.g. "steps")."""
    options = CaseOptions(**{name: getattr(case.options, name) for _, name, _ in OPTION_FLAGS})
    sel = CaseSelection(case.suite, case.model.name, world_size or case.layout.world_size,
                        (case.layout.id,) if layout else (), case.engine, case.backend, options)
    return sel.record_command(skip, variant_argv(id_fragment(case.params)) if params else [])
