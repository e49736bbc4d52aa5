"""Rank entry point: `python -m harness.launch.worker --case-file F --result-dir D` (spawned by the
runner, or under torchrun with env:// rendezvous). Writes rank<R>.pkl into D and exits."""

import time

_T0 = time.time()  # before the heavy imports: rank start-up = _T0 - spawn time

import argparse  # noqa: E402
import faulthandler  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402

from harness import adjustments  # noqa: E402
from harness.backends import Backend  # noqa: E402
from harness.errors import MissingDependency  # noqa: E402
from harness.launch import isolation  # noqa: E402
from harness.launch.context import RankContext  # noqa: E402
from harness.launch.rank_imports import MEGATRON, import_modules  # noqa: E402
from harness.launch.results import RankMemory, RankResult, read, write_atomic  # noqa: E402
from harness.platform import parallel, without_te  # noqa: E402
from harness.platform.backend import CPU_RANK_THREADS  # noqa: E402
from harness.probes import proc  # noqa: E402
from harness.spec import Case  # noqa: E402
from harness.suite_registry import load_suite  # noqa: E402


def init_distributed(ctx: RankContext, timeout_s: float) -> None:
    """Process group for the rank: a FileStore from the local runner, env:// under torchrun."""
    import torch
    import torch.distributed as dist

    if ctx.backend == Backend.NCCL:
        torch.cuda.set_device(ctx.local_rank)
        without_te.define_router_gemm()
    else:
        from harness.platform import cpu_layer

        cpu_layer.activate()
        torch.set_num_threads(CPU_RANK_THREADS)  # why one: harness/platform/backend.py
    timeout = timedelta(seconds=timeout_s)
    store_path = os.environ.get("HARNESS_STORE")
    if store_path:
        store = dist.FileStore(store_path, ctx.world_size)
        dist.init_process_group(ctx.backend, store=store, rank=ctx.rank, world_size=ctx.world_size, timeout=timeout)
    else:
        dist.init_process_group(ctx.backend, init_method="env://", rank=ctx.rank, world_size=ctx.world_size,
                                timeout=timeout)
    all_connected(ctx.backend)


def all_connected(backend: Backend) -> None:
    """Return only once every rank's gloo connections are up: gloo's connecting side of a pair is done when it
    has written its handshake, its accepting side only when it has read it, and torch adds no barrier to
    init_process_group or new_group (TORCH_DIST_INIT_BARRIER=0). Without this a rank whose case issues no
    collective could finish and close its sockets while a peer, descheduled on a loaded machine, was still
    accepting: the peer failed its init with "Gloo connectFullMesh failed ... Connection closed by peer".
    NCCL connects at the first collective, inside the case."""
    import torch.distributed as dist

    if backend == Backend.GLOO:
        dist.barrier()


def shutdown_distributed(ctx: RankContext) -> None:
    import torch.distributed as dist

    from harness.platform import cpu_layer

    if "megatron.core.parallel_state" in sys.modules:
        parallel.teardown_parallel_state()
    if dist.is_initialized():
        dist.destroy_process_group()
    cpu_layer.deactivate()


def run_rank(case: Case, ctx: RankContext, *, own_process_group: bool = True,
             exits_on_failure: bool = False, ends_process: bool = False) -> RankResult:
    """Run the case's suite work on this rank; never raises (errors go into the result).

    With own_process_group=False (torchrun, several cases per process) the process group outlives
    the case and only megatron's parallel state is torn down. exits_on_failure (a warm pool's rank; a rank with
    its own process group always does): the process ends after a failed case, so there is no teardown to wait
    for - on NCCL ranks destroying a group waits for the operations issued on it, which peers that failed
    elsewhere never match, and the failure would reach the parent as a timeout without its traceback.
    ends_process (a rank of one case, exec'd or forked per case): the process ends after the case whatever its
    outcome, so nothing is torn down (0.4-0.5 s of groups destroyed and memory collected a case on 2 cores).
    """
    adjustments.take()  # nothing a previous case noted belongs to this one
    result = ctx.result
    try:
        rss_before = _reset_peak_rss()
        with ctx.phase("imports"):
            import torch  # noqa: F401

            suite = load_suite(case.suite_ref or case.suite)
            import_modules(suite.imports, on_cpu=case.backend != Backend.NCCL)
        if own_process_group:
            with ctx.phase("init"):
                init_distributed(ctx, case.timeout_s)
        result.phase = "rank_work"  # outside any timed phase of the suite's own
        result.data = suite.rank_work(case, ctx) or {}
        result.adjustments = adjustments.take()
        # Warm ranks: the peak is reset per case and the baseline RSS is kept beside it.
        result.memory = RankMemory(rss_before, _status_mib("VmHWM"), proc.thread_count())
    except BaseException as exc:  # noqa: BLE001 - a rank reports everything, including SystemExit
        result.ok = False
        result.error = traceback.format_exc()
        if isinstance(exc, MissingDependency):  # this installation cannot run the case: a skip, not a failure
            result.skip_reason = str(exc)
    if ends_process or (not result.ok and (own_process_group or exits_on_failure)):
        return result  # the process ends here; peers may be gone, so no collective teardown
    failed_in = result.phase
    try:  # also after a failure: a torchrun rank goes on to the next case
        with ctx.phase("teardown"):
            if own_process_group:
                shutdown_distributed(ctx)
            elif "megatron.core.parallel_state" in sys.modules:
                parallel.teardown_parallel_state()
    except BaseException:  # noqa: BLE001
        if result.ok:
            result.ok = False
            result.error = traceback.format_exc()
            failed_in = "teardown"
    if not result.ok:
        result.phase = failed_in
    return result


def _status_mib(field: str) -> float:
    """A /proc/self/status field in MiB; NaN where it cannot be read (the rank's figures are informative)."""
    try:
        return proc.status_field("self", field) / (1024 * 1024)
    except proc.MeasurementError:
        return float("nan")


def _reset_peak_rss() -> float:
    """Reset VmHWM to the current RSS (Linux clear_refs 5) and return the current RSS in MiB."""
    proc.reset_peak_rss()
    return _status_mib("VmRSS")


def pool_main(pool_dir: Path) -> None:
    """A warm rank: one process group for its life, cases read from stdin one directory per line.

    After each case it checks that nothing leaked (harness.launch.isolation); a failed or leaking
    case is the last one this rank runs (the pool then starts fresh ranks).
    """
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = Backend(os.environ["HARNESS_BACKEND"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    startup = RankContext(rank, world, local_rank, backend, pool_dir)
    startup.result.timings["rank_start"] = max(0.0, _T0 - float(os.environ.get("HARNESS_SPAWN_T", _T0)))
    with startup.phase("imports"):
        import_modules(MEGATRON, on_cpu=backend != Backend.NCCL, optional=True)
    with startup.phase("init"):
        init_distributed(startup, float(os.environ.get("HARNESS_PG_TIMEOUT", "1800")))
    isolation.start_lazy_threads()
    isolation.no_progress_bar_monitor()
    freeze_long_lived()
    baseline = isolation.snapshot()
    first = True
    for line in sys.stdin:
        case_dir = Path(line.strip())
        if not line.strip() or line.strip() == "exit":
            break
        case: Case = read(case_dir / "case.pkl")
        ctx = RankContext(rank, world, local_rank, backend, case_dir)
        first_case = first
        if first:  # the pool's start-up is paid by its first case
            ctx.result.timings.update(startup.result.timings)
            first = False
        modules = len(sys.modules)
        result = run_rank(case, ctx, own_process_group=False, exits_on_failure=True)
        if not result.ok:  # reported before anything that could wait on the device (empty_cache) or on peers
            write_result(case_dir, result)
            break
        # What the case left collected and its heap given back before the next: after a grad-sync case with the
        # distributed optimizer its DDP (a reference cycle through the gradient hooks) and with it 16 destroyed
        # gloo groups (48 threads) outlived the teardown's collection and ran through the whole next case.
        parallel.release_memory()
        after = isolation.snapshot()
        if first_case and backend == Backend.NCCL:
            # CUDA and NCCL start threads of their own at first use, for the process's life (not verified on a
            # GPU): a GPU rank's thread count is held to what it had after its first case
            baseline["threads"] = after["threads"]
        leaked = isolation.leaks(baseline, after)
        result.leaks = leaked
        write_result(case_dir, result)
        if leaked:
            break
        if len(sys.modules) > modules:
            # The modules the case imported (a suite's, an engine's, a test's plant) live as long as the rank: out of
            # the collector's sight from now on, as the start-up's are. What else is alive after a collection is
            # what every case leaves (the freeze stops no object from being freed when its last reference goes).
            freeze_long_lived()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def freeze_long_lived() -> None:
    """Move what the rank holds for its whole life (modules, the process group) out of the garbage collector's
    sight: a full collection then scans a case's objects only. Measured on a warm `tiny` rank: the teardown's
    gc.collect took 0.2-0.37 s of 0.26-0.44 s per case over ~400k import-time objects."""
    import gc

    gc.collect()
    gc.freeze()


def write_result(result_dir: Path, result: RankResult) -> None:
    """rank<R>.pkl, plus an empty rank<R>.failed marker the supervisor can see without unpickling."""
    if not result.ok:
        (result_dir / f"rank{result.rank}.failed").touch()
    write_atomic(result_dir / f"rank{result.rank}.pkl", result)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--case-file", type=Path)
    parser.add_argument("--result-dir", type=Path)
    parser.add_argument("--pool-dir", type=Path, help="run as a warm pool rank (cases from stdin)")
    args = parser.parse_args(argv)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the runner asks hung ranks for stacks
    faulthandler.enable(all_threads=True)  # a rank that crashes (a segfault) leaves every thread's stack in its log
    if args.pool_dir:
        pool_main(args.pool_dir)
    if not (args.case_file and args.result_dir):
        parser.error("--case-file and --result-dir are required (or --pool-dir)")

    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    case: Case = read(args.case_file)
    ctx = RankContext(rank, world_size, int(os.environ.get("LOCAL_RANK", rank)), case.backend, args.result_dir)
    ctx.result.timings["rank_start"] = max(0.0, _T0 - float(os.environ.get("HARNESS_SPAWN_T", _T0)))
    result = run_rank(case, ctx, ends_process=True)
    write_result(args.result_dir, result)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: atexit hooks of torch / megatron can block once peers are gone.
    os._exit(0 if result.ok else 1)


if __name__ == "__main__":
    main()
