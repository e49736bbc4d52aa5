"""`harness nightly`: every suite x models x construction paths, then the report (harness/nightly.py)."""

from __future__ import annotations

from pathlib import Path

from harness import stack
from harness.commands.common import say
from harness.errors import BadInput
from harness.nightly import SUITES, other_stacks, run_nightly, worst_exit
from harness.selection import SHARED_FLAGS


def add_parser(sub) -> None:
    p = sub.add_parser("nightly", help="every suite x models x construction paths, then the report")
    p.add_argument("--out", required=True, help="directory for every run's results.json and the report")
    p.add_argument("--suite", action="append", help="only these suites (repeatable; default: all)")
    p.add_argument("--model", action="append",
                   help="models (repeatable; 'default' is each suite's own; default: every CPU reference model "
                        "on gloo, default + small + 1b-2k on GPUs)")
    p.add_argument("--world-size", type=int, default=None, help="default: the node's GPUs, or 4 CPU ranks")
    p.add_argument("--backend", **SHARED_FLAGS["--backend"])
    p.add_argument("--engine", default=None, help="only this construction path (default: every one; "
                                                  "peft-ckpt: megatron-bridge)")
    p.add_argument("--label", default=None, help="names every run of this nightly in the report and the history")
    p.add_argument("--history-db", default=None, help="the history database every run is ingested into at the end "
                                                      "(default: OUT/history.sqlite)")
    p.add_argument("--other-stack", action="append", metavar="NAME=PYTHON", default=[],
                   help="also run the nightly on another stack: a name and the python of its environment, which has "
                        "the harness installed (e.g. previous=.nox/stack-previous/bin/python; repeatable); each stack "
                        "then writes into OUT/<stack>/, the history database is shared and the other stack's runs are "
                        "labelled NAME (their own series)")
    p.set_defaults(func=main)


def main(args) -> int:
    if args.world_size is not None and args.world_size < 1:
        raise BadInput(f"--world-size must be >= 1, got {args.world_size}")
    out = Path(args.out)
    history_db = Path(args.history_db) if args.history_db else None
    if not args.other_stack:
        return run_nightly(out, args.suite or list(SUITES), args.model, args.world_size, args.backend, args.engine,
                           say, label=args.label, history_db=history_db)

    others = other_stacks(args.other_stack)  # BadInput before anything runs
    history_db = history_db or out / "history.sqlite"
    codes = [run_nightly(out / stack.key(), args.suite or list(SUITES), args.model, args.world_size, args.backend,
                         args.engine, say, label=args.label, history_db=history_db)]
    for (name, python), key in others.items():
        if codes[-1] in INTERRUPTED:  # a stop asked for (CI's timeout, Ctrl-C) stops the other stacks too
            break
        say(f"nightly: the {name} stack ({key}, {python}) into {out / key}")
        label = f"{args.label}-{name}" if args.label else name
        codes.append(_run_other(python, out / key, history_db, label, args))
    return worst_exit(codes)


INTERRUPTED = (130, 143, -2, -15)  # exit codes of a run stopped by SIGINT / SIGTERM (its own, or as a signal)


def _run_other(python: str, out: Path, history_db: Path, label: str, args) -> int:
    """`harness nightly` in another environment with this one's selection, its runs labelled; its exit code."""
    import subprocess

    argv = [python, "-m", "harness.cli", "nightly", "--out", str(out), "--history-db", str(history_db),
            "--backend", str(args.backend), "--label", label]
    for flag, values in (("--suite", args.suite), ("--model", args.model)):
        for v in values or []:
            argv += [flag, v]
    for flag, value in (("--world-size", args.world_size), ("--engine", args.engine)):
        if value is not None:
            argv += [flag, str(value)]
    return subprocess.run(argv).returncode
