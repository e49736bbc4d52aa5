"""What repeated saves leave behind in a rank: the heap allocations made during several saves of the same state
that are still live after them (their objects dropped and garbage collected; memray's leaked allocations of a
tracker around the saves), and the rank's RSS after each save.

One save's peak says nothing about this: memory a save keeps shows in its peak only where it exceeds that save's
own transient (under a gathering format it never does), and a rank that keeps a little of every save runs out of
memory days into a job that saves every N steps.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from harness.probes.memory import in_c10d
from harness.probes.proc import MeasurementError, status_field


@dataclass(frozen=True)
class Retention:
    """A rank's memory kept by `saves` saves, in bytes."""

    saves: int
    kept: int  # heap allocated during the saves and still live after them (memray; the rank's own process)
    kept_allocations: int
    rss_after: list[int] = field(default_factory=list)  # VmRSS before the first save, then after each
    capture: str = ""  # memray capture of the saves (its leaks flamegraph shows what stayed)
    # what stayed that torch.distributed allocated itself (memory.in_c10d; not in `kept`): its flight recorder's
    # entries, a ring of TORCH_FR_BUFFER_SIZE collectives (about 1.4 KiB each until it is full), DTensor's caches
    bookkeeping: int = 0
    # where what stayed was allocated: (the innermost frames "function file:line" of the stack, bytes, allocations),
    # largest first
    top: list[tuple[str, int, int]] = field(default_factory=list)

    @property
    def per_save(self) -> float:
        return self.kept / self.saves if self.saves else 0.0


def measure_retention(save: Callable[[int], None], saves: int, capture: Path, c10d_apart: bool = False
                      ) -> Retention:
    """Run save(i) for i in range(saves) under a memray tracker; what each allocated and still holds once the
    garbage collector ran is memray's leaked allocations at the tracker's end. c10d_apart: what a collective
    allocated inside torch.distributed itself is counted apart (`bookkeeping`), not as kept."""
    import memray

    for old in capture.parent.glob(capture.name + "*"):
        old.unlink()
    gc.collect()
    rss = [status_field("self", "VmRSS")]
    # Aggregated in the rank: the leaked records are the same as from a capture of every allocation, and reading
    # them back costs nothing, where reading every allocation back took longer than the saves themselves.
    with memray.Tracker(capture, native_traces=False, trace_python_allocators=True, follow_fork=False,
                        file_format=memray.FileFormat.AGGREGATED_ALLOCATIONS):
        for i in range(saves):
            save(i)
            gc.collect()
            rss.append(status_field("self", "VmRSS"))
    try:
        records = list(memray.FileReader(str(capture)).get_leaked_allocation_records(merge_threads=True))
    except (OSError, RuntimeError, ValueError) as exc:
        raise MeasurementError(f"memray capture {capture} is unreadable ({type(exc).__name__}: {exc})") from exc
    apart = [r for r in records if c10d_apart and in_c10d(r)]
    records = [r for r in records if not (c10d_apart and in_c10d(r))]
    return Retention(saves, sum(r.size for r in records), sum(r.n_allocations for r in records), rss, str(capture),
                     top=_largest(records), bookkeeping=sum(r.size for r in apart))



def _largest(records: list, n: int = 5, depth: int = 4) -> list[tuple[str, int, int]]:
    """The n call sites (their innermost `depth` Python frames) that hold the most of what stayed."""
    sites: dict[str, list[int]] = {}
    for r in records:
        frames = [f"{fn} {file.rsplit('/', 1)[-1]}:{line}" for fn, file, line in r.stack_trace(max_stacks=depth)]
        site = sites.setdefault(" < ".join(frames) or "(no Python frame)", [0, 0])
        site[0] += r.size
        site[1] += r.n_allocations
    return sorted(((k, b, n_) for k, (b, n_) in sites.items()), key=lambda x: -x[1])[:n]
