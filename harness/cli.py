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


def _options(args) -> CaseOptions:
    return CaseOptions(
        steps=args.steps, seed=args.seed, dtype=args.dtype,
        use_distributed_optimizer=args.distributed_optimizer, overlap_grad_reduce=args.overlap_grad_reduce,
        fully_parallel_save=args.fully_parallel_save, async_save=args.async_save,
    )


def _case_kwargs(args) -> dict:
    """Keyword arguments of driver.plan / run_suite from the shared case-selection flags."""
    return dict(engine=args.engine, backend=args.backend, options=_options(args), timeout_s=args.timeout,
                ckpt_formats=args.ckpt_format)


def _run(args) -> int:
    from harness import report
    from harness.driver import plan, run_suite

    kwargs = _case_kwargs(args)
    plan(args.suite, args.model, args.world_size, args.layout, **kwargs)  # all bad input -> exit 2 first
    run = run_suite(args.suite, args.model, args.world_size, args.layout, fresh_ranks=args.fresh_ranks,
                    shuffle_seed=args.shuffle, baselines_dir=args.baselines_dir, **kwargs)
    print(report.format_run(run))
    if args.out:
        path = report.write_results(run, Path(args.out))
        print(f"results: {path}")
    return 0 if run.passed else 1


def _baselines(args) -> int:
    from harness import baselines, report
    from harness.driver import plan, run_suite

    kwargs = _case_kwargs(args)
    suite, cases = plan(args.suite, args.model, args.world_size, args.layout, **kwargs)
    if not hasattr(suite, "samples"):
        raise BadInput(f"suite {args.suite!r} has no baselines")
    if args.action == "check":
        run = run_suite(args.suite, args.model, args.world_size, args.layout, baselines_dir=args.baselines_dir,
                        **kwargs)
        print(report.format_run(run))
        return 0 if run.passed else 1
    try:
        path, diff = baselines.record_suite(args.suite, args.model, args.world_size, args.layout,
                                            repeats=args.repeats, baselines_dir=args.baselines_dir, **kwargs)
    except RuntimeError as exc:
        print(f"harness: error: {exc}", file=sys.stderr)
        return 1
    print(f"recorded {path}:\n{diff}")
    return 0


def _project_memory(args) -> int:
    from harness.checks.memory_model import MIB, project, save_band
    from harness.layouts import validate
    from harness.models import load_model
    from harness.spec import Layout

    model = load_model(args.model)
    layout = validate(Layout.parse(args.layout), model)
    formats = [args.format] if args.format else ["dp_reshardable", "fully_reshardable", "fully_reshardable_mem_efficient"]
    print(f"model {model.name} ({model.num_params() / 1e9:.2f}B params), layout {layout.id}, "
          f"{args.ranks_per_node} ranks per node")
    for fmt in formats:
        try:
            p = project(fmt, model, layout, args.ranks_per_node)
        except ValueError as exc:
            raise BadInput(str(exc)) from None
        band = save_band(fmt, model, layout, p.worst_rank)
        gib = 1024 * MIB
        print(f"{fmt:<34} per rank (worst: rank {p.worst_rank}) {p.per_rank_low / gib:8.1f} - {p.per_rank_high / gib:8.1f} GiB"
              f"   per node up to {p.per_node_high / gib:9.1f} GiB   [{band.why}]")
    print("checked against measured CPU points: baselines/cpu-gloo/ckpt-memory.json (suite ckpt-memory, "
          "check 'ckpt-memory.model')")
    return 0


def _add_case_args(p: argparse.ArgumentParser) -> None:
    """The flags that select a suite's cases (shared by run, baselines, bisect)."""
    p.add_argument("--suite", required=True, help="equivalence, grad-sync, ckpt-memory, dynamic-cp (step-perf: planned)")
    p.add_argument("--model", default=None, help="model spec (default: the suite's CPU model, tiny or small)")
    p.add_argument("--world-size", type=int, default=4, help="ranks per case (default 4)")
    p.add_argument("--layout", action="append", help="layout id (repeatable); default: the suite's matrix")
    p.add_argument("--engine", default="mcore", help="mcore, or a user engine package.module:factory")
    p.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--distributed-optimizer", action="store_true", help="use_distributed_optimizer=True")
    p.add_argument("--overlap-grad-reduce", action="store_true")
    p.add_argument("--timeout", type=float, default=None, help="per-case timeout in seconds (default 300)")
    p.add_argument("--ckpt-format", action="append", help="ckpt-memory: only these formats (repeatable)")
    p.add_argument("--fully-parallel-save", action="store_true",
                   help="ckpt-memory: save through megatron's FullyParallelSaveStrategyWrapper")
    p.add_argument("--async-save", action="store_true",
                   help="ckpt-memory: megatron's async save (the write in a forked process)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="harness", description="Regression harness for Megatron-based training engines.")
    sub = p.add_subparsers(dest="command", required=True)

    lay = sub.add_parser("layouts", help="list the valid TP/PP/CP/DP layouts of a world size for a model")
    lay.add_argument("--world-size", type=int, required=True)
    lay.add_argument("--model", required=True)
    lay.add_argument("--layout", action="append", help="check these layout ids instead of listing all")
    lay.set_defaults(func=_layouts)

    run = sub.add_parser("run", help="run a suite over layouts on local ranks and judge it")
    _add_case_args(run)
    run.add_argument("--out", help="directory for results.json")
    run.add_argument("--fresh-ranks", action="store_true",
                     help="start new rank processes for every case instead of reusing warm ones")
    run.add_argument("--shuffle", type=int, metavar="SEED", default=None,
                     help="run the cases in a shuffled order (isolation check)")
    run.add_argument("--baselines-dir", default=None, help="default: the repository's baselines/")
    run.set_defaults(func=_run)

    bl = sub.add_parser("baselines", help="record or check stored baselines")
    bl.add_argument("action", choices=["record", "check"])
    _add_case_args(bl)
    bl.add_argument("--repeats", type=int, default=3)
    bl.add_argument("--baselines-dir", default=None)
    bl.set_defaults(func=_baselines)

    pm = sub.add_parser("project-memory", help="predicted host memory of a checkpoint save at scale")
    pm.add_argument("--model", required=True)
    pm.add_argument("--layout", required=True)
    pm.add_argument("--format", default=None)
    pm.add_argument("--ranks-per-node", type=int, default=8)
    pm.set_defaults(func=_project_memory)
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
