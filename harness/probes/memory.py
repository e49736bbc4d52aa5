"""Phase-scoped host (and device) memory of a rank and of the processes it forks.

Host: memray's heap high-water mark of the rank and, with follow_fork, of every writer process a
checkpoint save forks (each child writes its own capture file); plus the RSS high-water mark of the
rank (VmHWM, reset per phase through /proc/self/clear_refs) and a sampler of its children's RSS.
Device: torch.cuda peak allocated / reserved, reset per phase, and what the phase held of torch's pinned
host pool (a GPU save's device-to-host copies are cut from it; host memory the heap figures miss once
the pool has its blocks).

A measurement that cannot be taken raises MeasurementError in the rank (the case errors with the
reason) instead of reading as 0 bytes: no capture, an unreadable capture, a sampler without a sample.
"""

from __future__ import annotations

import contextlib
import gc
import glob
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.errors import MissingDependency
from harness.probes.proc import MeasurementError, descendants, reset_peak_rss, status_field

MIB = 1024 * 1024


# Without it memray sees Python objects only as the 1 MiB arenas pymalloc maps (CPython >= 3.10, 64-bit):
# a save's peak then moved by a whole arena with the heap's fill state - fsdp2 saves of `small` repeated at
# 0.36 or 1.35-1.5 MiB per rank, +1.13 MiB at the unpickling of DCP's broadcast metadata (8 allocations
# of 1.128 MiB against 6 of 0.135 MiB) - and the baselines refused them as noisy.
TRACE_PYTHON_ALLOCATORS = True


def flamegraph_path(capture: str) -> str:
    """Where the report stage renders the flamegraph of a memray capture."""
    return capture.replace(".bin", ".html") if capture else "(no capture)"


def artifacts_dir(case_id: str) -> Path:
    """A directory of the case's own under $HARNESS_ARTIFACTS, shared by every run of the same case id: for a
    case run outside the driver (no output directory), e.g. where it saves a checkpoint."""
    import re
    import tempfile

    root = Path(os.environ.get("HARNESS_ARTIFACTS", Path(tempfile.gettempdir()) / "harness-artifacts"))
    path = root / re.sub(r"[^A-Za-z0-9_.=-]+", "_", case_id)
    path.mkdir(parents=True, exist_ok=True)
    return path


def captures_dir(case: Any) -> Path:
    """Where a case's memray captures live until the parent has judged them: private to its run (beside the
    run's directory, which is deleted when the run ends, while a failed check's flamegraph stays), so two runs
    of the same case at once - a suite beside the tests, two workers - never read or delete each other's."""
    import re

    if not case.out_dir:  # a case run outside the driver
        return artifacts_dir(case.id)
    path = run_captures(Path(case.out_dir).parent) / re.sub(r"[^A-Za-z0-9_.=-]+", "_", case.id)
    path.mkdir(parents=True, exist_ok=True)
    return path


def run_captures(run_dir: Path) -> Path:
    """The captures directory of a run (driver.new_run_dir): beside it, so deleting the run keeps it."""
    return run_dir.with_name(run_dir.name + "-captures")


@dataclass
class MemoryPeak:
    """Peaks of one phase of one rank, in bytes."""

    phase: str
    heap_peak: int = 0  # memray: the rank's own high-water of live heap allocated during the phase
    children_heap_peak: int = 0  # memray: largest high-water among forked children
    children: int = 0  # forked processes seen by memray
    rss_before: int = 0
    rss_peak: int = 0  # VmHWM during the phase (reset at its start)
    children_rss_peak: int = 0  # sampled sum of the children's RSS
    device_allocated_peak: int = 0
    device_reserved_peak: int = 0
    device_allocated_before: int = 0  # torch.cuda.memory_allocated() at the phase's start
    # torch's caching host (pinned) allocator, device ranks only: the most bytes of its blocks in use during
    # the phase above what was in use at its start, and how much the pool grew in it (a block cut during the
    # phase is an mmap memray may see too)
    pinned_peak: int = 0
    pinned_grown: int = 0
    capture: str = ""  # memray capture of the rank (kept for flamegraphs)
    timeline: list[tuple[float, int]] = field(default_factory=list)  # (s, rank RSS bytes) samples

    @property
    def host_peak(self) -> int:
        """Extra host memory of the phase: the rank's heap peak plus its writers' peak plus the pinned
        staging it held (less what the pool grew by in the phase, which the heap figure may hold already)."""
        return self.heap_peak + self.children_heap_peak + max(0, self.pinned_peak - self.pinned_grown)

    @property
    def device_peak(self) -> int:
        """Extra device memory of the phase: its allocated high-water above what was allocated at its start."""
        return max(0, self.device_allocated_peak - self.device_allocated_before)


class _Sampler(threading.Thread):
    """Samples the rank's RSS and its children's; the first sample is taken however short the phase."""

    def __init__(self, interval_s: float = 0.01):
        super().__init__(daemon=True)
        self.interval_s, self.stop_event = interval_s, threading.Event()
        self.children_peak = 0
        self.timeline: list[tuple[float, int]] = []
        self.error = ""  # the last reason a sample could not be taken

    def run(self) -> None:
        try:
            import psutil

            me, t0 = psutil.Process(), time.monotonic()
        except Exception as exc:  # noqa: BLE001 - reported by measure() as "no sample"
            self.error = f"{type(exc).__name__}: {exc}"
            return
        while True:
            try:
                self._sample(psutil, me, t0)
            except (psutil.Error, MeasurementError) as exc:
                self.error = f"{type(exc).__name__}: {exc}"
            if self.stop_event.wait(self.interval_s):
                return

    def _sample(self, psutil, me, t0: float) -> None:
        total = 0
        kids = descendants()
        if kids is None:
            kids = [k.pid for k in me.children(recursive=True)]
        for k in kids:
            try:
                total += status_field(k, "VmRSS")
            except MeasurementError:
                pass  # a child that exited between listing and reading
        rss = status_field("self", "VmRSS")
        self.children_peak = max(self.children_peak, total)
        self.timeline.append((time.monotonic() - t0, rss))


@contextlib.contextmanager
def measure(phase: str, capture_dir: Path, rank: int, use_memray: bool = True, device: bool = False):
    """Measure the enclosed phase; yields the MemoryPeak, filled in on exit.

    A full collection first: what a reference cycle of an earlier phase holds is not freed inside this one,
    and the collector's generation counts start at zero, so a collection inside the phase (which frees the
    phase's own cyclic garbage and lowers its peak) comes at the same allocation whatever the rank ran before."""
    gc.collect()
    peak = MemoryPeak(phase)
    capture = capture_dir / f"memray-{phase}-rank{rank}.bin"
    for old in glob.glob(f"{capture}*"):
        os.unlink(old)
    reset_peak_rss()  # VmHWM from the current RSS on
    peak.rss_before = status_field("self", "VmRSS")
    pinned_before: dict[str, int] = {}
    if device:
        import torch

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        peak.device_allocated_before = torch.cuda.memory_allocated()
        pinned_before = _pinned_pool(reset=True)
    sampler = _Sampler()
    sampler.start()
    tracker: contextlib.AbstractContextManager = contextlib.nullcontext()
    if use_memray:
        import memray

        tracker = memray.Tracker(capture, follow_fork=True, native_traces=False,
                                 trace_python_allocators=TRACE_PYTHON_ALLOCATORS)
    try:
        with tracker:
            try:
                yield peak
            finally:
                # the sampler stops inside the tracked block: no thread of ours runs while memray stops
                sampler.stop_event.set()
                sampler.join()
    finally:
        sampler.stop_event.set()
        sampler.join()
    # only after a phase that completed: a failure inside it keeps its own exception
    _fill(peak, sampler, capture if use_memray else None, rank, device, pinned_before)


def _fill(peak: MemoryPeak, sampler: _Sampler, capture: Path | None, rank: int, device: bool,
          pinned_before: dict[str, int]) -> None:
    if not sampler.timeline:
        raise MeasurementError(f"the RSS sampler took no sample during {peak.phase} on rank {rank} "
                               f"({sampler.error or 'it never ran'})")
    peak.rss_peak = status_field("self", "VmHWM")
    peak.children_rss_peak = sampler.children_peak
    peak.timeline = sampler.timeline[:: max(1, len(sampler.timeline) // 200)]
    if device:
        import torch

        torch.cuda.synchronize()
        peak.device_allocated_peak = torch.cuda.max_memory_allocated()
        peak.device_reserved_peak = torch.cuda.max_memory_reserved()
        pool = _pinned_pool()
        # Above the phase's start: on the first GPU runs (torch 2.11) the pool's active bytes never came back
        # down when a save's blocks were freed and reused, so the raw peak grew case after case in a warm rank
        # (184, 368, 414 ... 1199 MiB over 11 saves of `small`, the pool itself not growing at all). Where the
        # count never comes down, the rise is every block handed out in the phase: at least its staging peak.
        peak.pinned_peak = max(0, pool["active_bytes.peak"] - pinned_before["active_bytes.current"])
        peak.pinned_grown = max(0, pool["allocated_bytes.current"] - pinned_before["allocated_bytes.current"])
    if capture is not None:
        peak.capture = str(capture)
        peak.heap_peak, peak.children_heap_peak, peak.children = read_captures(capture)


def _pinned_pool(reset: bool = False) -> dict[str, int]:
    """torch.cuda.host_memory_stats() (torch >= 2.7), its peaks reset first when asked. On a torch without it
    the case is skipped with the reason (MissingDependency): a GPU save's pinned host staging would go
    unmeasured, and a host figure without it is not what the model and the baselines judge."""
    import torch

    stats = getattr(torch.cuda, "host_memory_stats", None)
    reset_peak = getattr(torch.cuda, "reset_peak_host_memory_stats", None)
    if stats is None or reset_peak is None:
        raise MissingDependency(f"torch {torch.__version__} has no torch.cuda.host_memory_stats / "
                                "reset_peak_host_memory_stats: a GPU save's pinned host staging cannot be measured "
                                "(torch >= 2.7 has them)")
    if reset:
        reset_peak()
    s = stats()  # keys "active_bytes.peak" (torch's docs), "active_bytes.all.peak" in some releases
    return {k: int(s.get(k, s.get(k.replace(".", ".all.", 1), 0)))
            for k in ("allocated_bytes.current", "active_bytes.current", "active_bytes.peak")}


def read_captures(capture: Path) -> tuple[int, int, int]:
    """(rank heap peak, largest child heap peak, number of children) from memray capture files.

    The rank's own capture must exist and be readable; forked writers' captures (`<capture>.<pid>`)
    are absent when nothing forked, and must be readable when present."""
    if not os.path.exists(capture):
        raise MeasurementError(f"memray wrote no capture at {capture}: the phase's heap peak was not measured")
    own = _peak_of(str(capture))
    if own <= 0:
        raise MeasurementError(f"memray capture {capture} recorded no allocation: the tracker saw nothing")
    kids = [_peak_of(p) for p in sorted(glob.glob(f"{capture}.*"))]
    return own, max(kids, default=0), len(kids)


def _peak_of(path: str) -> int:
    import memray

    try:
        return memray.FileReader(path).metadata.peak_memory
    except (OSError, RuntimeError, ValueError) as exc:
        raise MeasurementError(f"memray capture {path} is unreadable ({type(exc).__name__}: {exc})") from exc


_CPU_LAYER = "harness/platform/cpu_layer.py"


def in_c10d(record) -> bool:
    """Whether a memray allocation record was made by torch.distributed itself: within the innermost run of torch's
    own frames there is one of torch.distributed's (a collective, DTensor's redistribution), or it has no Python
    frame (a native thread's: gloo's workers run a collective's transfers and build an all_gather's flat buffer).
    gloo's transport buffers, torch's flight recorder (a ring of TORCH_FR_BUFFER_SIZE entries, about 1.4 KiB per
    collective until it is full) and DTensor's plan caches - not what the caller built or kept."""
    frames = record.stack_trace(max_stacks=16)
    for _, file, _ in frames:
        if file.endswith(_CPU_LAYER):  # the CPU layer's stand-ins call torch on torch's behalf
            continue
        if "/torch/" not in file:
            return False
        if "/torch/distributed/" in file:
            return True
    return not frames


def largest_allocation(capture: str) -> tuple[int, str]:
    """(bytes, where: its innermost Python frames) of the largest single allocation a memray capture recorded
    outside torch.distributed's collectives (in_c10d): the largest buffer the phase itself built at once."""
    import memray

    # a release of memory (munmap carries the size it unmapped) has no stack of its own
    releases = {memray.AllocatorType.FREE, memray.AllocatorType.MUNMAP, memray.AllocatorType.PYMALLOC_FREE}
    try:
        records = [r for r in memray.FileReader(capture).get_allocation_records()
                   if r.size and r.allocator not in releases and not in_c10d(r)]
    except (OSError, RuntimeError, ValueError) as exc:
        raise MeasurementError(f"memray capture {capture} is unreadable ({type(exc).__name__}: {exc})") from exc
    best = max(records, key=lambda r: r.size, default=None)
    if best is None:
        raise MeasurementError(f"memray capture {capture} recorded no allocation: the tracker saw nothing")
    frames = [f"{fn} {file.rsplit('/', 1)[-1]}:{line}" for fn, file, line in best.stack_trace(max_stacks=4)]
    return best.size, " < ".join(frames) or "(no Python frame)"
