"""A rank killed by the memory profiler itself: memray's tracker crashing as it stops (a segfault or bus error in
`Tracker.__exit__`: on megatron-core 0.19.2's CPU ranks in refit's export, on mcore and on fsdp2, cases that passed
when run again). That is no verdict on the code under test: the case runs once more, and says so."""

from __future__ import annotations

import linecache
import re

from harness.launch.results import CaseResult

_FATAL = re.compile(r"Fatal Python error: (Segmentation fault|Bus error)")
_CURRENT = re.compile(r"^Current thread 0x[0-9a-f]+ \(most recent call first\):$")
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)$')
# the harness's own memray trackers: the phase probe and the retention probe
_TRACKER_SITES = ("harness/probes/memory.py", "harness/probes/retention.py")


def profiler_crash(result: CaseResult) -> str:
    """How a rank of a failed case was killed by memray's tracker stopping, or "" when none was."""
    if result.ok:
        return ""
    for rank in result.ranks:
        where = _crash_site(rank.error or "")
        if where:
            return f"rank {rank.rank} was killed by memray's tracker as it stopped ({where})"
    return ""


def _crash_site(error: str) -> str:
    """The innermost frame of the crashing thread when it is a memray tracker's exit in the harness's probes."""
    lines = error.splitlines()
    fatal, kind = next(((i, m[1]) for i, line in enumerate(lines) for m in [_FATAL.search(line)] if m), (None, ""))
    if fatal is None:
        return ""
    current = next((i for i in range(fatal, len(lines)) if _CURRENT.match(lines[i].strip())), None)
    if current is None or current + 1 >= len(lines):
        return ""
    frame = _FRAME.match(lines[current + 1])
    if not frame or not frame["file"].endswith(_TRACKER_SITES):
        return ""
    source = linecache.getline(frame["file"], int(frame["line"]))
    if "tracker" not in source.lower():  # the with-statement of a memray.Tracker, not the phase it measured
        return ""
    return f"{kind.lower()} in {frame['func']}, {frame['file'].rsplit('/', 1)[-1]}:{frame['line']}"
