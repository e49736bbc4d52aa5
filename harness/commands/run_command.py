"""`harness run`: a suite over layouts on local ranks, judged."""

from __future__ import annotations

from harness.baselines import BASELINES_DIR_FLAG
from harness.commands.case_args import add_case_args
from harness.commands.common import existing_baselines_dir, out_dir
from harness.errors import BadInput
from harness.report.directory import refuse_earlier_run
from harness.report.terminal import format_run
from harness.selection import CaseSelection
from harness.suite_defs import Baselined


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="run a suite over layouts on local ranks and judge it")
    add_case_args(p)
    p.add_argument("--out", help="directory for results.json (refused where an earlier run's files are, "
                                 "unless --force)")
    p.add_argument("--force", action="store_true", help="replace the earlier run in --out")
    p.add_argument("--label", default=None, help="names this run in reports and the history (e.g. the engine's "
                                                 "branch), so runs of one engine at two versions are told apart")
    p.add_argument("--fresh-ranks", action="store_true",
                   help="start new rank processes for every case instead of reusing warm ones")
    p.add_argument("--shuffle", type=int, metavar="SEED", default=None,
                   help="run the cases in a shuffled order (isolation check)")
    p.add_argument("--baselines-dir", **BASELINES_DIR_FLAG)
    p.set_defaults(func=main)


def main(args) -> int:
    from harness.driver import execute, plan

    sel = CaseSelection.from_args(args)
    if args.shuffle is not None and args.shuffle < 0:
        raise BadInput(f"--shuffle takes a seed >= 0, got {args.shuffle}")
    planned = plan(sel, baselines_dir=args.baselines_dir)  # bad input: exit 2
    if isinstance(planned.suite, Baselined):
        existing_baselines_dir(args.baselines_dir, planned.suite.name)
    out = out_dir(args.out)
    if out:
        refuse_earlier_run(out, args.force)
    run = execute(planned, fresh_ranks=args.fresh_ranks, shuffle_seed=args.shuffle, out_dir=out, label=args.label)
    print(format_run(run))
    if out:
        print(f"results: {out / 'results.json'}")
    return run.exit_code
