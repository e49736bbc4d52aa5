"""Run a suite under torchrun (one or many nodes): every rank runs the cases in turn in-process,
results are gathered to rank 0 over a gloo group, and rank 0 judges, prints and writes them.

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m harness.torchrun --suite equivalence --model 8b --out results/
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from harness import driver
from harness.backends import Backend
from harness.baselines import BASELINES_DIR_FLAG
from harness.driver import new_run_dir
from harness.errors import BadInput
from harness.launch.context import RankContext
from harness.launch.results import CaseResult
from harness.launch.worker import freeze_long_lived, init_distributed, run_rank, shutdown_distributed
from harness.outcomes import EXIT_BAD_INPUT, CaseStatus
from harness.platform.backend import CPU_RANK_ENV, GPU_RANK_ENV, gpus_from_device_files, resolve_backend
from harness.platform.parallel import release_memory
from harness.report.terminal import format_run
from harness.selection import SHARED_FLAGS, TIMEOUT_FLAG, option_flags
from harness.spec import Case, CaseOptions
from harness.suite_flags import param_flags
from harness.suite_registry import default_dtype


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.torchrun", description=__doc__)
    p.add_argument("--suite", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--layout", action="append")
    p.add_argument("--engine", **SHARED_FLAGS["--engine"])
    p.add_argument("--backend", **SHARED_FLAGS["--backend"])
    p.add_argument("--out")
    p.add_argument("--baselines-dir", **BASELINES_DIR_FLAG)
    declared = {pf.field: pf for pf in [*option_flags(), *param_flags()]}  # as CaseOptions and StepPerfParams say
    declared["steps"].add_to(p.add_argument)
    declared["timed_steps"].add_to(p.add_argument)
    p.add_argument("--timeout", **TIMEOUT_FLAG)
    p.add_argument("--verbose", action="store_true", help="log every rank's phases to stderr")
    args = p.parse_args(argv)
    if not args.verbose:
        os.environ["HARNESS_PHASE_LOG"] = "0"
    rank = int(os.environ["RANK"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    try:  # every local rank its own GPU, counted without torch: a gloo rank must never see one
        backend = resolve_backend(args.backend, local_world, gpus=gpus_from_device_files())
    except BadInput as exc:
        if rank == 0:
            print(f"harness: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if backend == Backend.GLOO:
        os.environ.update(CPU_RANK_ENV)  # before torch is imported: a gloo rank sees no GPU
    else:
        for name, value in GPU_RANK_ENV.items():  # before torch's inductor reads its config
            os.environ.setdefault(name, value)

    import torch.distributed as dist

    world = int(os.environ["WORLD_SIZE"])
    try:
        suite_params = {"timed_steps": args.timed_steps} if args.timed_steps is not None else None
        planned = driver.plan(args.suite, args.model, world, args.layout, engine=args.engine, backend=backend,
                              options=CaseOptions(**({"steps": args.steps} if args.steps is not None else {}),
                                                  dtype=default_dtype(args.suite, backend)),
                              timeout_s=args.timeout, suite_params=suite_params, baselines_dir=args.baselines_dir,
                              local_world_size=local_world)
    except BadInput as exc:
        if rank == 0:
            print(f"harness: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    base = RankContext(rank, world, local_rank, backend, Path(os.environ.get("TMPDIR", "/tmp")))
    init_distributed(base, max(c.timeout_s for c in planned.cases))
    freeze_long_lived()  # one process runs every case, as a warm pool rank does
    runner = TorchrunRanks(base, dist.new_group(backend="gloo"))  # results travel as objects, on the CPU
    out = Path(args.out) if args.out and rank == 0 else None
    run = driver.execute(planned, runner=runner, out_dir=out)
    code = 0
    if rank == 0:
        print(format_run(run))
        if out is not None:
            print(f"results: {out / 'results.json'}")
        code = run.exit_code
    shutdown_distributed(base)
    return code


class TorchrunRanks:
    """The executor's cases under torchrun (harness.driver.CaseRunner): every process runs each case in-process
    on the world's process group; rank 0 gathers the ranks' results over a gloo group and judges."""

    def __init__(self, base: RankContext, group: Any):
        self.base, self.group = base, group
        self.judges = base.rank == 0
        self.run_dir = Path()

    def start(self) -> Path:
        """One directory for the run (the driver's new_run_dir: $HARNESS_ARTIFACTS, which several nodes must
        share, since a case's checkpoint is written by the ranks of every node), named by rank 0."""
        import torch.distributed as dist

        shared = [str(new_run_dir()) if self.judges else ""]
        dist.broadcast_object_list(shared, src=0, group=self.group)
        self.run_dir = Path(shared[0])
        return self.run_dir

    def run(self, case: Case) -> CaseResult | None:
        import torch.distributed as dist

        t_case = time.monotonic()
        b = self.base
        workdir = self.run_dir / "work" / Path(case.out_dir).name  # the case's own scratch, as a pool rank's
        workdir.mkdir(parents=True, exist_ok=True)  # on every node
        rank_result = run_rank(case, RankContext(b.rank, b.world_size, b.local_rank, b.backend, workdir),
                               own_process_group=False)
        release_memory()
        gathered: list[Any] | None = [None] * b.world_size if self.judges else None
        dist.gather_object(rank_result, gathered, dst=0, group=self.group)
        if gathered is None:
            return None
        failed = [r for r in gathered if not r.ok]
        error = (f"case {case.id}: rank {failed[0].rank} failed in phase '{failed[0].phase}'\n"
                 f"{failed[0].error}") if failed else ""
        return CaseResult(case, gathered, CaseStatus.ERROR if failed else CaseStatus.OK, error,
                          time.monotonic() - t_case)

    def agree(self, stop: str) -> str:
        """Every rank stops alike when rank 0 finds the first cases all errored alike (harness/broken_env.py)."""
        import torch.distributed as dist

        box = [stop]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def abort(self) -> None:
        """Nothing to kill: the ranks are torchrun's processes, which it ends."""

    def finish(self, run_dir: Path) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.group)
        if self.base.local_rank == 0:
            shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
