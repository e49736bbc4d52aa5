"""What the harness reads from Linux's /proc: status fields (VmRSS, VmHWM, ...), the reset of the RSS
high-water mark, the thread count. A figure that cannot be read raises MeasurementError (never 0 bytes)."""

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
