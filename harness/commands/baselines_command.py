"""`harness baselines record|check|diff`: stored baselines of a suite's metrics."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from harness import baselines, platform
from harness.baselines import BASELINES_DIR_FLAG
from harness.commands.case_args import add_case_args
from harness.commands.common import existing_baselines_dir
from harness.errors import BadInput, DoesNotFit, MissingDependency
from harness.platform import resolve_backend
from harness.report.terminal import format_run
from harness.selection import CaseSelection
from harness.suite_defs import Baselined, get_suite


def add_parser(sub) -> None:
    p = sub.add_parser("baselines", help="record, check or diff stored baselines",
                       description="record: run the suite --repeats times and store median, spread and tolerance "
                                   "(refused when a metric is too noisy); check: run and compare; diff: the "
                                   "baseline file against git (--against REV, default HEAD) or another file (--old)")
    p.add_argument("action", choices=["record", "check", "diff"])
    add_case_args(p, suite_required=False)
    p.add_argument("--missing", action="store_true",
                   help="record: every baseline the regression suites (pytest suites) look for on this platform, "
                        "world size and backend and lack, suite by suite (--suite: that suite's only)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--baselines-dir", **BASELINES_DIR_FLAG)
    p.add_argument("--platform", default=None, help="diff: platform key (default: this machine's, e.g. cpu-gloo)")
    p.add_argument("--against", default="HEAD", help="diff: git revision of the old file (default HEAD)")
    p.add_argument("--old", default=None, help="diff: compare with this file instead of a git revision")
    p.set_defaults(func=main)


def main(args) -> int:
    from harness.driver import execute, plan
    from harness.recording import record_suite

    if args.missing:
        return record_missing(args)
    if not args.suite:
        raise BadInput("--suite is required (or, to record what this platform lacks: baselines record --missing)")
    if args.action == "diff":
        return diff(args)
    sel = CaseSelection.from_args(args)
    if args.repeats < 3:
        raise BadInput(f"--repeats must be >= 3 so the spread can set the tolerance, got {args.repeats}")
    planned = plan(sel, baselines_dir=args.baselines_dir, full_timing=args.action == "record")
    if not isinstance(planned.suite, Baselined):
        raise BadInput(f"suite {args.suite!r} has no baselines")
    if args.action == "check":
        existing_baselines_dir(args.baselines_dir, planned.suite.name)
        run = execute(planned)
        print(format_run(run))
        return run.exit_code
    try:
        path, changes = record_suite(planned, repeats=args.repeats)  # the plan made above, run `repeats` times
    except RuntimeError as exc:
        print(f"harness: error: {exc}", file=sys.stderr)
        return 1
    print(f"recorded {path}:\n{changes}")
    return 0


def diff(args) -> int:
    """The suite's baseline file against a git revision of it (--against) or another file (--old)."""
    suite = get_suite(args.suite)
    key = args.platform or platform.detect_platform(resolve_backend(args.backend, args.world_size)).key
    path = baselines.suite_path(args.baselines_dir, key, suite.name)
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


def record_missing(args) -> int:
    """`record --missing`: each run of the regression suites that lacks an entry here, its whole matrix recorded
    (so a file's entries of one run come from one recording); exit 1 where a recording was refused."""
    from harness.recording import missing_baselines, record_suite

    if args.action != "record":
        raise BadInput(f"--missing records what is missing: `harness baselines record --missing`, not {args.action}")
    given = [flag for flag, value in (("--model", args.model), ("--layout", args.layout)) if value]
    if given:
        raise BadInput(f"--missing records the models and layouts the regression suites run; drop "
                       f"{' and '.join(given)}")
    if args.repeats < 3:
        raise BadInput(f"--repeats must be >= 3 so the spread can set the tolerance, got {args.repeats}")
    if args.suite:
        if not isinstance(get_suite(args.suite), Baselined):
            raise BadInput(f"suite {args.suite!r} has no baselines")
    todo = missing_baselines(args.world_size, args.backend, args.baselines_dir, args.suite)
    if not todo:
        print(f"nothing missing: every baseline the regression suites look for at world size {args.world_size} "
              f"is recorded (an entry recorded before a metric was measured is named by the suite's check, with "
              f"the command that records it again)")
        return 0
    for m in todo:
        print(f"{m.suite} {m.model}: {len(m.missing)} of {m.planned} entries missing from {m.path}", flush=True)
    refused = []
    started = time.monotonic()
    for i, m in enumerate(todo, 1):
        print(f"[{i}/{len(todo)}] recording {m.suite} {m.model} ({args.repeats} repeats)", file=sys.stderr, flush=True)
        run_started = time.monotonic()
        try:
            path, changes = record_suite(m.suite, m.model, args.world_size, repeats=args.repeats,
                                         baselines_dir=args.baselines_dir, backend=args.backend)
        except (RuntimeError, MissingDependency, DoesNotFit) as exc:
            refused.append(f"{m.suite} {m.model}: {exc}")
            print(f"harness: error: {m.suite} {m.model}: not recorded: {exc}", file=sys.stderr, flush=True)
            continue
        print(f"recorded {path} in {time.monotonic() - run_started:.0f} s:\n{changes}", flush=True)
    if refused:
        print(f"harness: error: {len(refused)} of {len(todo)} runs not recorded ({time.monotonic() - started:.0f} s "
              f"in all):\n  " + "\n  ".join(r.splitlines()[0] for r in refused), file=sys.stderr)
        return 1
    print(f"recorded every missing baseline of the regression suites at world size {args.world_size} "
          f"({len(todo)} runs in {time.monotonic() - started:.0f} s)")
    return 0
