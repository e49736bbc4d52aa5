"""The `harness` command. Exit codes: 0 all checks pass, 1 a check failed, 2 bad input."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from harness.errors import BadInput
from harness.spec import CaseOptions


def _layouts(args) -> int:
    from harness.layouts import enumerate_layouts, validate
    from harness.models import load_model
    from harness.spec import Layout

    model = load_model(args.model)
    if args.world_size < 1:
        raise BadInput(f"--world-size must be >= 1, got {args.world_size}")
    if args.layout:
        for lid in args.layout:
            lay = validate(Layout.parse(lid), model, args.world_size)
            print(f"{lay.id}\ttp={lay.tp} pp={lay.pp} cp={lay.cp} dp={lay.dp}  valid")
        return 0
    for lay in enumerate_layouts(model, args.world_size):
        print(f"{lay.id}\ttp={lay.tp} pp={lay.pp} cp={lay.cp} dp={lay.dp}")
    return 0


def _run(args) -> int:
    from harness import report
    from harness.driver import plan, run_suite

    options = CaseOptions(
        steps=args.steps, seed=args.seed, dtype=args.dtype,
        use_distributed_optimizer=args.distributed_optimizer, overlap_grad_reduce=args.overlap_grad_reduce,
    )
    kwargs = dict(engine=args.engine, backend=args.backend, options=options, timeout_s=args.timeout)
    plan(args.suite, args.model, args.world_size, args.layout, **kwargs)  # all bad input -> exit 2 first
    run = run_suite(args.suite, args.model, args.world_size, args.layout, fresh_ranks=args.fresh_ranks,
                    shuffle_seed=args.shuffle, **kwargs)
    print(report.format_run(run))
    if args.out:
        path = report.write_results(run, Path(args.out))
        print(f"results: {path}")
    return 0 if run.passed else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="harness", description="Regression harness for Megatron-based training engines.")
    sub = p.add_subparsers(dest="command", required=True)

    lay = sub.add_parser("layouts", help="list the valid TP/PP/CP/DP layouts of a world size for a model")
    lay.add_argument("--world-size", type=int, required=True)
    lay.add_argument("--model", required=True)
    lay.add_argument("--layout", action="append", help="check these layout ids instead of listing all")
    lay.set_defaults(func=_layouts)

    run = sub.add_parser("run", help="run a suite over layouts on local ranks and judge it")
    run.add_argument("--suite", required=True, help="equivalence (grad-sync, ckpt-memory, dynamic-cp, step-perf: planned)")
    run.add_argument("--model", required=True)
    run.add_argument("--world-size", type=int, required=True)
    run.add_argument("--layout", action="append", help="layout id (repeatable); default: the suite's matrix")
    run.add_argument("--engine", default="mcore", help="mcore, or a user engine package.module:factory")
    run.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    run.add_argument("--out", help="directory for results.json")
    run.add_argument("--steps", type=int, default=2)
    run.add_argument("--seed", type=int, default=1234)
    run.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    run.add_argument("--distributed-optimizer", action="store_true", help="use_distributed_optimizer=True")
    run.add_argument("--overlap-grad-reduce", action="store_true")
    run.add_argument("--timeout", type=float, default=None, help="per-case timeout in seconds (default 300)")
    run.add_argument("--fresh-ranks", action="store_true",
                     help="start new rank processes for every case instead of reusing warm ones")
    run.add_argument("--shuffle", type=int, metavar="SEED", default=None,
                     help="run the cases in a shuffled order (isolation check)")
    run.set_defaults(func=_run)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # `--engine package.module:factory` resolves against the working directory, as `python -m` would.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return args.func(args)
    except BadInput as exc:
        print(f"harness: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
