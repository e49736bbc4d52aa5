"""`harness baselines record|check|diff`: stored baselines of a suite's metrics."""

from __future__ import annotations

import sys
from pathlib import Path

from harness.commands.selection import CaseSelection, add_case_args
from harness.errors import BadInput


def add_parser(sub) -> None:
    p = sub.add_parser("baselines", help="record, check or diff stored baselines",
                       description="record: run the suite --repeats times and store median, spread and tolerance "
                                   "(refused when a metric is too noisy); check: run and compare; diff: the "
                                   "baseline file against git (--against REV, default HEAD) or another file (--old)")
    p.add_argument("action", choices=["record", "check", "diff"])
    add_case_args(p)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--baselines-dir", default=None)
    p.add_argument("--platform", default=None, help="diff: platform key (default: this machine's, e.g. cpu-gloo)")
    p.add_argument("--against", default="HEAD", help="diff: git revision of the old file (default HEAD)")
    p.add_argument("--old", default=None, help="diff: compare with this file instead of a git revision")
    p.set_defaults(func=main)


def main(args) -> int:
    from harness import report
    from harness.driver import plan, run_suite
    from harness.recording import record_suite
    from harness.suite_defs import Baselined

    if args.action == "diff":
        return diff(args)
    sel = CaseSelection.from_args(args)
    if args.repeats < 3:
        raise BadInput(f"--repeats must be >= 3 so the spread can set the tolerance, got {args.repeats}")
    suite, _ = plan(*sel.plan_args(), baselines_dir=args.baselines_dir, **sel.plan_kwargs())
    if not isinstance(suite, Baselined):
        raise BadInput(f"suite {args.suite!r} has no baselines")
    if args.action == "check":
        run = run_suite(*sel.plan_args(), baselines_dir=args.baselines_dir, **sel.plan_kwargs())
        print(report.format_run(run))
        return run.exit_code
    try:
        path, changes = record_suite(*sel.plan_args(), repeats=args.repeats, baselines_dir=args.baselines_dir,
                                     **sel.plan_kwargs())
    except RuntimeError as exc:
        print(f"harness: error: {exc}", file=sys.stderr)
        return 1
    print(f"recorded {path}:\n{changes}")
    return 0


def diff(args) -> int:
    """The suite's baseline file against a git revision of it (--against) or another file (--old)."""
    from harness import baselines
    from harness.platform import detect_platform, resolve_backend
    from harness.suite_defs import get_suite

    suite = get_suite(args.suite)
    platform = args.platform or detect_platform(resolve_backend(args.backend, args.world_size)).key
    path = baselines.baseline_path(args.baselines_dir, platform, suite.name)
    if not path.exists():
        raise BadInput(f"no baseline file {path}; record one with `harness baselines record --suite {suite.name}`")
    new = baselines.load(path)
    if args.old:
        if not Path(args.old).exists():
            raise BadInput(f"--old {args.old}: no such file")
        old, what = baselines.load(Path(args.old)), args.old
    else:
        old, what = baselines.load_at_revision(path, args.against), f"{path.name} at {args.against}"
    print(f"{what} -> {path}:")
    print(baselines.diff_entries(old.get("entries", {}), new["entries"], removed=True))
    return 0
