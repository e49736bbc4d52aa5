"""What the harness reads from Linux's /proc: status fields (VmRSS, VmHWM, ...), the reset of the RSS
high-water mark, the threads, a process's descendants. A figure that cannot be read raises
MeasurementError (never 0 bytes)."""

from __future__ import annotations

import os


class MeasurementError(RuntimeError):
    """A memory figure could not be measured; raised in the rank so the case errors with this reason."""


def status_field(pid: int | str, name: str) -> int:
    """A /proc/<pid>/status field in bytes (pid 'self' for this process; the kernel gives kB)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(name + ":"):
                    return int(line.split()[1]) * 1024
    except OSError as exc:
        raise MeasurementError(f"cannot read {name} from /proc/{pid}/status: {exc}") from exc
    raise MeasurementError(f"/proc/{pid}/status has no {name} line")


def reset_peak_rss() -> bool:
    """Reset this process's VmHWM to its current RSS (clear_refs 5); False where the kernel does not allow it
    (then VmHWM is the high-water mark since the process started)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def thread_count() -> int:
    """Threads of this process (/proc/self/task)."""
    return len(os.listdir("/proc/self/task"))


# threads torch starts once and keeps for the process's life: the autograd engine's device threads, which a CUDA
# build of torch starts at the first backward that runs device hooks (FSDP2's), on a machine without a GPU too
PROCESS_LIFETIME_THREADS = ("pt_autograd_",)


def thread_names(lifetime: bool = True) -> list[str]:
    """The names of this process's threads (each task's comm: e.g. pt_gloo_runloop, a gloo group's), sorted; a
    thread that ended while being read is left out, and so are the process-lifetime ones unless `lifetime`."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            continue
    return sorted(n for n in names if lifetime or not n.startswith(PROCESS_LIFETIME_THREADS))


# A kernel property (CONFIG_PROC_CHILDREN): read once, not in every sample.
_CHILDREN_FILES = os.path.exists(f"/proc/self/task/{os.getpid()}/children")


def descendants(pid: int | str = "self") -> list[int] | None:
    """Pids of a process's children, theirs, and so on, from /proc/<pid>/task/<tid>/children: it reads the
    process's own subtree, where psutil's children(recursive=True) reads /proc/<pid>/stat of every process on
    the machine (2.7 ms for 72 processes, against 0.1-0.4 ms here: a memory sampler runs it 100 times a
    second in every rank, whose gloo threads each have such a file). None where the kernel lacks the file
    (CONFIG_PROC_CHILDREN)."""
    if pid == "self":
        try:  # a rank that forked nothing (most phases) answers in one system call
            os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)  # WNOWAIT: reaps nothing
        except ChildProcessError:
            return []
    if not _CHILDREN_FILES:
        return None
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue  # exited since its parent listed it
        for tid in tids:
            try:
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out
