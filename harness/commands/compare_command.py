"""`harness compare`: A against B, interleaved in one run (harness/compare.py)."""

from __future__ import annotations

from harness.commands.case_args import add_case_args
from harness.commands.common import out_dir, say
from harness.compare import compare_main, pinned_package, plan_sides
from harness.engine_names import EngineName
from harness.errors import BadInput
from harness.selection import CaseSelection


def add_parser(sub) -> None:
    p = sub.add_parser("compare", help="A against B, interleaved in one run: two engines, or this environment "
                                       "against a megatron-core release or a commit (step-perf)")
    add_case_args(p, compare=True)
    p.add_argument("--rounds", type=int, default=5, help="rounds per side, A/B order drawn each round (default 5)")
    p.add_argument("--steps-per-round", type=int, default=10, help="timed steps per case per round (default 10)")
    p.add_argument("--megatron-core", default=None, metavar="VERSION", help="B: this megatron-core release")
    p.add_argument("--package", default=None, metavar="NAME==VERSION",
                   help="B: this release of any package the engine depends on (megatron-bridge, your framework), "
                        "installed as bisect installs its candidates")
    p.add_argument("--repo", help="B: a commit of this local checkout (with --rev)")
    p.add_argument("--rev", help="--repo: the commit to compare against")
    p.add_argument("--path-in-repo", default=".", help="--repo: the directory put on the path (default: root)")
    p.add_argument("--cache", default=None, help="environments and worktrees (default ~/.cache/harness-bisect)")
    p.add_argument("--order-seed", type=int, default=0, help="seed of the A/B order of the rounds")
    p.add_argument("--out", default=None, help="write compare.json here")
    p.set_defaults(func=main)


def main(args) -> int:
    if args.suite != "step-perf":
        raise BadInput(f"compare judges step times: --suite step-perf (got {args.suite!r})")

    pinned_package(args)  # a malformed --package, or two B sides, before anything runs
    sel = CaseSelection.from_args(args)
    if args.steps_per_round < 3:
        raise BadInput(f"--steps-per-round must be >= 3, got {args.steps_per_round}")
    if args.rounds < 2:
        raise BadInput(f"--rounds must be >= 2 (interleaving needs several rounds per side), got {args.rounds}")
    plans = plan_sides(sel, args.engine or [EngineName.MCORE], args.steps_per_round)  # every bad input before any rank
    out_dir(args.out)
    return compare_main(args, sel, say, plans)
