"""What repeated saves leave behind in a rank: the heap allocations made during each of several saves of the same
state that are still live after it (its objects dropped and garbage collected; memray's leaked allocations of a
tracker around the save), and the rank's RSS after each save.

One save's peak says nothing about this: memory a save keeps shows in its peak only where it exceeds that save's
own transient (under a gathering format it never does), and a rank that keeps a little of every save runs out of
memory days into a job that saves every N steps.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from harness.probes.proc import MeasurementError, status_field


@dataclass(frozen=True)
class Retention:
    """A rank's memory kept by `saves` saves, in bytes, each save tracked on its own."""

    saves: int
    kept: int  # heap allocated during the save that kept least and still live after it (memray; the rank itself)
    kept_allocations: int
    rss_after: list[int] = field(default_factory=list)  # VmRSS before the first save, then after each
    capture: str = ""  # memray capture of that save (its leaks flamegraph shows what stayed)
    # where what stayed was allocated: (the innermost frames "function file:line" of the stack, bytes, allocations),
    # largest first
    top: list[tuple[str, int, int]] = field(default_factory=list)
    kept_by_save: list[int] = field(default_factory=list)  # what each tracked save kept, in order

    @property
    def per_save(self) -> float:
        """What every save kept: the least of them. A cache that fills over the first saves of a process (seen on
        gloo ranks: 1 MiB of all_gather outputs in the first fully parallel saves after other formats' saves) shows
        in some of them; memory kept by every save shows in each."""
        return float(self.kept)


def measure_retention(save: Callable[[int], None], saves: int, capture: Path) -> Retention:
    """One untracked save(saves), then save(i) for i in range(saves), each under its own memray tracker: what a
    save allocated and still holds once the garbage collector ran is memray's leaked allocations at its tracker's
    end. The save that kept least is the figure; its capture is kept, the others deleted."""
    import memray

    for old in capture.parent.glob(capture.stem + "*"):
        old.unlink()
    save(saves)  # untracked: what a save keeps once (a cache it fills the first time) is not kept per save
    gc.collect()
    rss = [status_field("self", "VmRSS")]
    tracked = []
    for i in range(saves):
        path = capture.with_name(f"{capture.stem}-{i}{capture.suffix}")
        with memray.Tracker(path, native_traces=False, trace_python_allocators=True, follow_fork=False):
            save(i)
            gc.collect()
        rss.append(status_field("self", "VmRSS"))
        try:
            records = list(memray.FileReader(str(path)).get_leaked_allocation_records(merge_threads=True))
        except (OSError, RuntimeError, ValueError) as exc:
            raise MeasurementError(f"memray capture {path} is unreadable ({type(exc).__name__}: {exc})") from exc
        tracked.append((sum(r.size for r in records), sum(r.n_allocations for r in records), path, _largest(records)))
    least = min(tracked, key=lambda t: t[0])
    for _, _, path, _ in tracked:
        if path != least[2]:
            path.unlink(missing_ok=True)
    return Retention(saves, least[0], least[1], rss, str(least[2]), least[3], [t[0] for t in tracked])


def _largest(records: list, n: int = 5, depth: int = 4) -> list[tuple[str, int, int]]:
    """The n call sites (their innermost `depth` Python frames) that hold the most of what stayed."""
    sites: dict[str, list[int]] = {}
    for r in records:
        frames = [f"{fn} {file.rsplit('/', 1)[-1]}:{line}" for fn, file, line in r.stack_trace(max_stacks=depth)]
        site = sites.setdefault(" < ".join(frames) or "(no Python frame)", [0, 0])
        site[0] += r.size
        site[1] += r.n_allocations
    return sorted(((k, b, n_) for k, (b, n_) in sites.items()), key=lambda x: -x[1])[:n]
