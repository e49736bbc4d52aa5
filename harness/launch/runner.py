"""Local spawn: start N rank processes for a case, bound them by a timeout, collect their results.

Each case gets a fresh scratch directory holding the FileStore used for rendezvous (no TCP port
is chosen by us, so consecutive cases cannot collide), the pickled case, one log and one result
file per rank. Ranks run in their own session and die with the parent (PR_SET_PDEATHSIG), and
every rank's process group is SIGKILLed before run_case returns: no orphans.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from harness.backends import Backend
from harness.launch import zygote
from harness.launch.children import die_with_parent, import_path
from harness.launch.results import CaseResult, RankResult, read, write_atomic
from harness.outcomes import CaseStatus
from harness.platform.backend import CPU_RANK_ENV, GPU_RANK_ENV, cpu_share
from harness.spec import Case

GRACE_S = 5.0  # how long peers of a failed rank may still finish before they are killed
STACK_WAIT_S = 1.5  # how long hung ranks get to dump their stacks after SIGUSR1
_PHASE_RE = re.compile(r"\[harness\] rank \d+ phase (\S+)")


def rank_env(case: Case, rank: int, workdir: Path) -> dict[str, str]:
    """The environment of rank `rank` of the case: rendezvous through a FileStore in workdir."""
    world = case.layout.world_size
    env = dict(os.environ)
    env.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
        HARNESS_STORE=str(workdir / "store"), HARNESS_SPAWN_T=repr(time.time()),
        PYTHONPATH=import_path(),
        OMP_NUM_THREADS=str(cpu_share(world)),  # a GPU rank's; a gloo rank's is CPU_RANK_ENV's
        PYTHONUNBUFFERED="1",
    )
    env.pop("MASTER_ADDR", None)
    env.pop("MASTER_PORT", None)
    if case.backend == Backend.GLOO:
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env.update(CPU_RANK_ENV)
    else:
        env.update({k: env.get(k, v) for k, v in GPU_RANK_ENV.items()})  # the user's setting wins
    return env


def _tail(path: Path, lines: int = 30) -> str:
    """The log's last lines; where the rank died with Python's fatal-error report (faulthandler), the whole report
    from its first line, the threads without a Python frame left out: a rank of many threads (gloo's, OpenMP's)
    otherwise pushes the report's head and the crashing thread's frames out of the last lines."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    kept = text.rstrip().splitlines()
    fatal = max((i for i, line in enumerate(kept) if line.startswith("Fatal Python error: ")), default=None)
    if fatal is None:
        return "\n".join(kept[-lines:])
    report = kept[fatal:]
    out: list[str] = []
    for line, after in zip(report, [*report[1:], ""]):
        if "<no Python frame>" in line or (line.startswith("Thread 0x") and "<no Python frame>" in after):
            continue  # another thread, with no Python frame to show
        if not line.strip() and out and not out[-1].strip():
            continue  # the blank lines around the threads left out, one kept
        out.append(line)
    return "\n".join(kept[max(0, fatal - 3):fatal] + out)


def _last_phase(log: Path) -> str:
    try:
        found = _PHASE_RE.findall(log.read_text(errors="replace"))
    except OSError:
        return "?"
    return found[-1] if found else "start-up"


def kill_ranks(procs: Sequence[subprocess.Popen | zygote.ForkedRank]) -> None:
    """SIGKILL every rank's process group (the rank and anything it started) and reap the ranks."""
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


def spawn_rank(argv: list[str], env: dict[str, str], log: Path, backend: Backend,
               stdin=subprocess.DEVNULL, preload: tuple[str, ...] = ()) -> subprocess.Popen | zygote.ForkedRank:
    """Start one rank (`python -m harness.launch.worker ARGV`) in its own session, dying with us, logging to log:
    forked from the zygote that imported `preload` (gloo), else exec'd.

    Every rank the harness starts - fresh (run_case) or pooled (RankPool) - starts here.
    """
    server = zygote.get(preload) if zygote.enabled(backend) else None
    if server is not None:
        try:
            return server.fork(argv, env, log, stdin)
        except (OSError, ValueError):  # it died under us: this rank is exec'd, the next start gets a new one
            zygote.close(preload)
    with open(log, "ab") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "harness.launch.worker", *argv], stdin=stdin, stdout=f,
            stderr=subprocess.STDOUT, env=env, start_new_session=True,
            preexec_fn=functools.partial(die_with_parent, os.getpid()),
        )


def supervise(procs: Sequence[subprocess.Popen | zygote.ForkedRank], result_dir: Path, timeout_s: float, grace_s: float,
              t0: float) -> tuple[list[int | None], bool]:
    """Wait until every rank wrote its result (or exited); stop early when one fails or time runs out.

    Returns the exit codes (None: still running) and whether the case timed out.
    """
    world = len(procs)
    first_failure: float | None = None
    while True:
        codes = [p.poll() for p in procs]
        done = [(result_dir / f"rank{r}.pkl").exists() or codes[r] is not None for r in range(world)]
        if all(done):
            return codes, False
        now = time.monotonic()
        failed = any(c not in (None, 0) for c in codes) or any(
            (result_dir / f"rank{r}.failed").exists() for r in range(world))
        if first_failure is None and failed:
            first_failure = now
        if first_failure is not None and now - first_failure > grace_s:
            return codes, False
        if now - t0 > timeout_s:
            for r, p in enumerate(procs):
                if not done[r]:
                    try:
                        os.kill(p.pid, signal.SIGUSR1)  # faulthandler dumps all stacks to the log
                    except ProcessLookupError:
                        pass
            time.sleep(STACK_WAIT_S)
            return [p.poll() for p in procs], True
        time.sleep(0.02)


def collect(case: Case, result_dir: Path, logs: list[Path], codes: list[int | None], timed_out: bool,
            wall: float) -> CaseResult:
    """Read the ranks' results; explain every missing one from its exit code and log."""
    ranks: list[RankResult] = []
    for r in range(len(logs)):
        path = result_dir / f"rank{r}.pkl"
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
    return CaseResult(case, ranks, status, error, wall)


def run_case(case: Case, *, keep_workdir: bool = False, grace_s: float = GRACE_S,
             preload: tuple[str, ...] = ()) -> CaseResult:
    """Run the case on layout.world_size fresh local ranks (forked from the fork server that imported `preload`,
    where they are forked); never raises for rank failures."""
    world = case.layout.world_size
    workdir = Path(tempfile.mkdtemp(prefix="harness-case-"))
    write_atomic(workdir / "case.pkl", case)
    procs: list[subprocess.Popen | zygote.ForkedRank] = []
    logs = [workdir / f"rank{r}.log" for r in range(world)]
    t0 = time.monotonic()
    try:
        for r in range(world):
            procs.append(spawn_rank(["--case-file", str(workdir / "case.pkl"), "--result-dir", str(workdir)],
                                    rank_env(case, r, workdir), logs[r], case.backend, preload=preload))
        codes, timed_out = supervise(procs, workdir, case.timeout_s, grace_s, t0)
        # A rank that wrote its result exits right after (os._exit); give those a moment.
        deadline = time.monotonic() + 2.0
        for r, p in enumerate(procs):
            if (workdir / f"rank{r}.pkl").exists():
                try:
                    p.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        codes = [p.poll() for p in procs]
    finally:
        kill_ranks(procs)
    result = collect(case, workdir, logs, codes, timed_out, time.monotonic() - t0)
    if result.ok and not keep_workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    elif not result.ok:
        result.error += f"\n(rank logs kept in {workdir})"
    return result


def _verdict(case: Case, ranks: list[RankResult], codes: list[int | None], timed_out: bool,
             wall: float) -> tuple[CaseStatus, str]:
    if timed_out:
        hung = [r.rank for r in ranks if codes[r.rank] is None]
        phases = ", ".join(f"rank {r} in '{ranks[r].phase}'" for r in hung)
        first = ranks[hung[0]] if hung else ranks[0]
        return CaseStatus.TIMEOUT, (f"case {case.id} timed out after {case.timeout_s:.0f}s: {phases} still running\n"
                           f"{first.error}")
    # The first rank that raised or died explains the case; peers killed afterwards only echo it.
    raised = [r for r in ranks if not r.ok and r.error and "was killed after a peer failed" not in r.error]
    skips = [r for r in raised if r.skip_reason]
    if skips and len(skips) == len(raised):  # no rank failed for another reason
        return CaseStatus.SKIPPED, skips[0].skip_reason
    if raised:
        r = raised[0]
        others = [x.rank for x in ranks if not x.ok and x is not r]
        head = (f"case {case.id}: rank {r.rank} failed in phase '{r.phase}'"
                + (f" (ranks {others} also failed or were stopped)" if others else ""))
        return CaseStatus.ERROR, f"{head}\n{r.error.rstrip()}"
    if any(not r.ok for r in ranks):
        return CaseStatus.ERROR, f"case {case.id}: ranks {[r.rank for r in ranks if not r.ok]} stopped"
    return CaseStatus.OK, ""
