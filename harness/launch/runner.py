"""Local spawn: start N rank processes for a case, bound them by a timeout, collect their results.

Each case gets a fresh scratch directory holding the FileStore used for rendezvous (no TCP port
is chosen by us, so consecutive cases cannot collide), the pickled case, one log and one result
file per rank. Ranks run in their own session and die with the parent (PR_SET_PDEATHSIG), and
every rank's process group is SIGKILLed before run_case returns: no orphans.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness.launch.results import CaseResult, RankResult, read, write_atomic
from harness.spec import Case

GRACE_S = 5.0  # how long peers of a failed rank may still finish before they are killed
STACK_WAIT_S = 1.5  # how long hung ranks get to dump their stacks after SIGUSR1
_PHASE_RE = re.compile(r"\[harness\] rank \d+ phase (\S+)")


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _rank_env(case: Case, rank: int, workdir: Path) -> dict[str, str]:
    world = case.layout.world_size
    env = dict(os.environ)
    env.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
        HARNESS_STORE=str(workdir / "store"), HARNESS_SPAWN_T=repr(time.time()),
        # Ranks import whatever the parent can (user engines, test fault plugins).
        PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
        OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // world)),
        PYTHONUNBUFFERED="1",
    )
    env.pop("MASTER_ADDR", None)
    env.pop("MASTER_PORT", None)
    if case.backend == "gloo":
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return env


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _last_phase(log: Path) -> str:
    try:
        found = _PHASE_RE.findall(log.read_text(errors="replace"))
    except OSError:
        return "?"
    return found[-1] if found else "start-up"


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def run_case(case: Case, *, keep_workdir: bool = False, grace_s: float = GRACE_S) -> CaseResult:
    """Run the case on layout.world_size local ranks; never raises for rank failures."""
    world = case.layout.world_size
    workdir = Path(tempfile.mkdtemp(prefix="harness-case-"))
    write_atomic(workdir / "case.pkl", case)
    procs: list[subprocess.Popen] = []
    logs = [workdir / f"rank{r}.log" for r in range(world)]
    t0 = time.monotonic()
    timed_out = False
    try:
        for r in range(world):
            with open(logs[r], "wb") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "harness.launch.worker",
                     "--case-file", str(workdir / "case.pkl"), "--result-dir", str(workdir)],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    env=_rank_env(case, r, workdir), start_new_session=True,
                    preexec_fn=_die_with_parent,
                ))
        first_failure: float | None = None
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                break
            now = time.monotonic()
            if first_failure is None and any(c not in (None, 0) for c in codes):
                first_failure = now
            if first_failure is not None and now - first_failure > grace_s:
                break
            if now - t0 > case.timeout_s:
                timed_out = True
                for p, c in zip(procs, codes):
                    if c is None:
                        try:
                            os.kill(p.pid, signal.SIGUSR1)  # faulthandler dumps all stacks to the log
                        except ProcessLookupError:
                            pass
                time.sleep(STACK_WAIT_S)
                break
            time.sleep(0.05)
        codes = [p.poll() for p in procs]
    finally:
        _kill(procs)
    wall = time.monotonic() - t0

    ranks: list[RankResult] = []
    for r in range(world):
        path = workdir / f"rank{r}.pkl"
        if path.exists():
            ranks.append(read(path))
            continue
        running = codes[r] is None
        what = "hung" if (running and timed_out) else ("was killed after a peer failed" if running else "died")
        ranks.append(RankResult(
            r, ok=False, phase=_last_phase(logs[r]),
            error=f"rank {r} {what} ({_exit_reason(codes[r])}) in phase '{_last_phase(logs[r])}'; "
                  f"last lines of {logs[r]}:\n{_tail(logs[r])}",
        ))
    status, error = _verdict(case, ranks, codes, timed_out, wall)
    if status == "ok" and not keep_workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    elif status != "ok":
        error += f"\n(rank logs kept in {workdir})"
    return CaseResult(case, ranks, status, error, wall)


def _verdict(case: Case, ranks: list[RankResult], codes: list[int | None], timed_out: bool,
             wall: float) -> tuple[str, str]:
    if timed_out:
        hung = [r.rank for r in ranks if codes[r.rank] is None]
        phases = ", ".join(f"rank {r} in '{ranks[r].phase}'" for r in hung)
        first = ranks[hung[0]] if hung else ranks[0]
        return "timeout", (f"case {case.id} timed out after {case.timeout_s:.0f}s: {phases} still running\n"
                           f"{first.error}")
    # The first rank that raised or died explains the case; peers killed afterwards only echo it.
    raised = [r for r in ranks if not r.ok and r.error and "was killed after a peer failed" not in r.error]
    if raised:
        r = raised[0]
        others = [x.rank for x in ranks if not x.ok and x is not r]
        head = (f"case {case.id}: rank {r.rank} failed in phase '{r.phase}'"
                + (f" (ranks {others} also failed or were stopped)" if others else ""))
        return "error", f"{head}\n{r.error.rstrip()}"
    if any(not r.ok for r in ranks):
        return "error", f"case {case.id}: ranks {[r.rank for r in ranks if not r.ok]} stopped"
    return "ok", ""
