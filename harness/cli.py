"""The `harness` command. Exit codes: 0 all checks pass, 1 a check failed, 2 bad input, 3 cases errored and no
check failed (the run could not measure), 5 nothing judged,
143 / 130 interrupted by SIGTERM / Ctrl-C (finished cases kept). Each subcommand is a module of
harness/commands/ (<command>_command.py: its flags and its body); this module builds the parser and runs one."""

from __future__ import annotations

import argparse
import atexit
import os
import signal
import sys
import warnings

from harness.commands import (
    baselines_command,
    bisect_command,
    compare_command,
    history_command,
    layouts_command,
    nightly_command,
    power_command,
    project_memory_command,
    report_command,
    run_command,
)
from harness.errors import BadInput, Interrupted
from harness.outcomes import EXIT_BAD_INPUT
from harness.stack import untested_warning

# in the order of `harness --help`
COMMANDS = (layouts_command, run_command, baselines_command, report_command, bisect_command, compare_command,
            nightly_command, history_command, project_memory_command, power_command)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="harness", description="Regression harness for Megatron-based training engines.")
    sub = p.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return p


def _raise_interrupted(signum, frame) -> None:
    raise Interrupted(signum)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    warning = untested_warning()  # a megatron-core outside the tested range runs, saying so once
    if warning:
        print(f"harness: {warning}", file=sys.stderr)
    # `--engine package.module:factory` resolves against the working directory, as `python -m` would.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    # SIGTERM (CI's timeout or cancel) unwinds like Ctrl-C: runs keep their finished cases (driver.run_suite)
    previous = signal.signal(signal.SIGTERM, _raise_interrupted)
    try:
        with warnings.catch_warnings():
            # megatron-core's import-time notes ("Transformer Engine and Apex are not installed") where planning
            # probes it in this process: a refusal stays one line; the ranks log theirs, and adjustments say it
            warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
            return args.func(args)
    except BadInput as exc:
        print(f"harness: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (Interrupted, KeyboardInterrupt) as exc:
        stop = exc if isinstance(exc, Interrupted) else Interrupted(signal.SIGINT)
        print(f"harness: interrupted ({stop}); what was written before is kept", file=sys.stderr)
        return stop.exit_code
    finally:
        signal.signal(signal.SIGTERM, previous)


def entry() -> None:
    """The `harness` command: main(), then an exit that skips tearing down the modules of torch and
    megatron-core (0.5-1 s of every command's wall); the exit hooks (warm ranks, the fork server) still run
    and the output is flushed."""
    code = main()
    run_exit_hooks = getattr(atexit, "_run_exitfuncs", None)  # CPython's
    if run_exit_hooks is None:
        sys.exit(code)
    run_exit_hooks()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
