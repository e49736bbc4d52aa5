"""Phase-scoped host (and device) memory of a rank and of the processes it forks.

Host: memray's heap high-water mark of the rank and, with follow_fork, of every writer process a
checkpoint save forks (each child writes its own capture file); plus the RSS high-water mark of the
rank (VmHWM, reset per phase through /proc/self/clear_refs) and a sampler of its children's RSS.
Device: torch.cuda peak allocated / reserved, reset per phase.
"""

from __future__ import annotations

import contextlib
import glob
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

MIB = 1024 * 1024


def artifacts_dir(case_id: str) -> Path:
    """Where a case's memray captures live until the parent has judged them ($HARNESS_ARTIFACTS)."""
    import re
    import tempfile

    root = Path(os.environ.get("HARNESS_ARTIFACTS", Path(tempfile.gettempdir()) / "harness-artifacts"))
    path = root / re.sub(r"[^A-Za-z0-9_.=-]+", "_", case_id)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _status_kib(field_name: str, pid: str = "self") -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


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
    capture: str = ""  # memray capture of the rank (kept for flamegraphs)
    timeline: list[tuple[float, int]] = field(default_factory=list)  # (s, rank RSS bytes) samples

    @property
    def host_peak(self) -> int:
        """Extra host memory of the phase: the rank's heap peak plus its writers' peak."""
        return self.heap_peak + self.children_heap_peak


class _Sampler(threading.Thread):
    def __init__(self, interval_s: float = 0.01):
        super().__init__(daemon=True)
        self.interval_s, self.stop_event = interval_s, threading.Event()
        self.children_peak = 0
        self.timeline: list[tuple[float, int]] = []

    def run(self) -> None:
        import psutil

        me, t0 = psutil.Process(), time.monotonic()
        while not self.stop_event.is_set():
            try:
                kids = me.children(recursive=True)
                total = 0
                for k in kids:
                    try:
                        total += k.memory_info().rss
                    except psutil.Error:
                        pass
                self.children_peak = max(self.children_peak, total)
                self.timeline.append((time.monotonic() - t0, me.memory_info().rss))
            except psutil.Error:
                pass
            self.stop_event.wait(self.interval_s)


@contextlib.contextmanager
def measure(phase: str, capture_dir: Path, rank: int, use_memray: bool = True, device: bool = False):
    """Measure the enclosed phase; yields the MemoryPeak, filled in on exit."""
    peak = MemoryPeak(phase)
    capture = capture_dir / f"memray-{phase}-rank{rank}.bin"
    for old in glob.glob(f"{capture}*"):
        os.unlink(old)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
    except OSError:
        pass
    peak.rss_before = _status_kib("VmRSS") * 1024
    if device:
        import torch

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    sampler = _Sampler()
    sampler.start()
    tracker = contextlib.nullcontext()
    if use_memray:
        import memray

        tracker = memray.Tracker(capture, follow_fork=True, native_traces=False)
    try:
        with tracker:
            yield peak
    finally:
        sampler.stop_event.set()
        sampler.join()
        peak.rss_peak = _status_kib("VmHWM") * 1024
        peak.children_rss_peak = sampler.children_peak
        peak.timeline = sampler.timeline[:: max(1, len(sampler.timeline) // 200)]
        if device:
            import torch

            torch.cuda.synchronize()
            peak.device_allocated_peak = torch.cuda.max_memory_allocated()
            peak.device_reserved_peak = torch.cuda.max_memory_reserved()
        if use_memray:
            peak.capture = str(capture)
            peak.heap_peak, peak.children_heap_peak, peak.children = read_captures(capture)


def read_captures(capture: Path) -> tuple[int, int, int]:
    """(rank heap peak, largest child heap peak, number of children) from memray capture files."""
    import memray

    def peak_of(path: str) -> int:
        try:
            return memray.FileReader(path).metadata.peak_memory
        except (OSError, RuntimeError, ValueError):
            return 0

    own = peak_of(str(capture))
    kids = [peak_of(p) for p in glob.glob(f"{capture}.*")]
    return own, max(kids, default=0), len(kids)
