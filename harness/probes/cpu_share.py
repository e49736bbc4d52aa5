"""Who else used the machine's CPUs while something was timed: the machine's busy time over the window
(/proc/stat: every CPU, the hypervisor's steal included) against the CPU time of the processes being timed.

A step time measured beside other work (a neighbour's build, another test, a VM's steal) says nothing about
the code; step-perf neither records nor judges such a figure. Linux only: elsewhere a window is not measured
(None) and the figure is judged as before.
"""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass

# Other processes may use this share of the machine's CPUs while steps are timed. Measured on a 2-core VM with
# 4 gloo ranks of tiny-moe: 0-1.2% with nothing else running (kernel threads, the harness's own driver; 30
# recorded cases); one busy loop beside them 30% (the step x1.27), two 33% (x1.19).
FOREIGN_LIMIT = 0.10


def _proc_stat() -> tuple[float, float, int] | None:
    """(busy seconds of every CPU, their steal seconds, number of CPUs) since boot, or None off Linux."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    # cpu user nice system idle iowait irq softirq steal guest guest_nice (guest time is inside user)
    total = [int(x) for x in lines[0].split()[1:9]]
    cpus = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
    hz = os.sysconf("SC_CLK_TCK")
    busy = total[0] + total[1] + total[2] + total[5] + total[6] + total[7]
    return busy / hz, total[7] / hz, cpus


def _own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process
    return usage.ru_utime + usage.ru_stime


@dataclass(frozen=True)
class CpuWindow:
    """One process's view of a window: the machine's busy and steal time and its own CPU time, seconds."""

    node: str  # processes on one node share its /proc/stat
    cpus: int
    wall_s: float
    machine_busy_s: float
    steal_s: float
    own_s: float


@contextlib.contextmanager
def cpu_window() -> Iterator[list[CpuWindow]]:
    """Measure the enclosed block; the list it yields holds its CpuWindow afterwards (empty off Linux)."""
    out: list[CpuWindow] = []
    start, own, t0 = _proc_stat(), _own_cpu_s(), time.perf_counter()
    yield out
    end = _proc_stat()
    if start is not None and end is not None:
        out.append(CpuWindow(socket.gethostname(), end[2], time.perf_counter() - t0, end[0] - start[0],
                             end[1] - start[1], _own_cpu_s() - own))


@dataclass(frozen=True)
class ForeignLoad:
    """The share of a node's CPUs that processes other than the timed ones used over the window (the node
    where it was largest), steal included."""

    share: float
    steal_share: float
    node: str
    cpus: int

    @property
    def too_busy(self) -> bool:
        return self.share > FOREIGN_LIMIT

    @property
    def slowdown(self) -> float:
        """The most the others' share slows the timed processes by: x1/(1-s) (s capped at 0.99)."""
        return 1 / (1 - min(self.share, 0.99))

    def describe(self) -> str:
        steal = f", {self.steal_share:.0%} of it the hypervisor's steal" if self.steal_share >= 0.005 else ""
        return f"other processes used {self.share:.0%} of {self.node}'s {self.cpus} CPUs{steal}"


def foreign_load(windows: list[CpuWindow]) -> ForeignLoad | None:
    """What the timed processes' windows say of everyone else, per node; None when no window was measured."""
    loads = []
    for node in sorted({w.node for w in windows}):
        mine = [w for w in windows if w.node == node]
        capacity = statistics.median(w.wall_s for w in mine) * mine[0].cpus
        if capacity <= 0:
            continue
        busy = statistics.median(w.machine_busy_s for w in mine)
        foreign = max(0.0, busy - sum(w.own_s for w in mine))
        steal = statistics.median(w.steal_s for w in mine)
        loads.append(ForeignLoad(min(1.0, foreign / capacity), steal / capacity, node, mine[0].cpus))
    return max(loads, key=lambda load: load.share, default=None)
