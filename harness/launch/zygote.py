"""The fork server of CPU ranks: one process imports torch and megatron-core once, and every gloo rank is
forked from it.

On CPU a rank's start-up is almost all imports (torch and megatron-core: about 4 s per rank, 9 s for four
ranks on two cores). A forked rank starts with those modules imported and nothing else: no process group, no
case, no parameters, no threads, the environment and working directory of the harness at the moment it was
asked for. NCCL ranks are still exec'd (CUDA must not be initialised in a process that forks), and
HARNESS_FORK_RANKS=0 execs every rank as before.

Protocol, over a Unix socketpair (SOCK_SEQPACKET): the harness sends {argv, env, cwd, log} as JSON with the
rank's stdin as a passed file descriptor; the zygote forks and answers {pid}. The harness is not the parent of
the ranks and cannot wait for them, so the zygote reaps them and writes each exit status to <dir>/<pid>,
where `ForkedRank.poll` reads it. The zygote dies with the harness and the ranks with the zygote
(PR_SET_PDEATHSIG), so killing the harness leaves no rank behind.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from harness.backends import Backend
from harness.files import atomic_write
from harness.launch import worker
from harness.launch.children import die_with_parent, import_path
from harness.launch.rank_imports import MEGATRON, import_modules
from harness.platform.backend import CPU_RANK_ENV

# Imported by the server before any fork, required; then megatron-core's modules, where installed.
PRELOAD = ("torch", "torch.distributed", "harness.launch.worker")
READY_TIMEOUT_S = 600.0  # imports on a loaded 2-core machine; a zygote that dies before is noticed at once


def enabled(backend: Backend) -> bool:
    """Whether ranks of this backend are forked from the zygote."""
    return backend == Backend.GLOO and os.environ.get("HARNESS_FORK_RANKS", "1") != "0"


class ForkedRank:
    """A rank forked by the zygote, with the part of subprocess.Popen the runner and the pool use."""

    def __init__(self, pid: int, status: Path, stdin, zygote: Zygote):
        self.pid, self.stdin = pid, stdin
        self.returncode: int | None = None
        self._status, self._zygote = status, zygote

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.returncode = int(self._status.read_text())
            except (FileNotFoundError, ValueError):
                if not self._zygote.alive and not _exists(self.pid):  # died with its zygote, unreaped by us
                    self.returncode = -signal.SIGKILL
        return self.returncode

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout or 0.0)
            time.sleep(0.01)
        return code


def _exists(pid: int) -> bool:
    """Whether the process runs: a zombie does not (one orphaned by its server's death waits for init to reap it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True


class Zygote:
    """The harness's end: starts the server process and asks it for ranks. preload: modules it imports besides
    PRELOAD and megatron-core's (a suite's whose cases each run on ranks of their own, an engine's). from_server: a
    running server this one is forked from, having imported what that one has (else it is started afresh)."""

    def __init__(self, preload: tuple[str, ...] = (), from_server: Zygote | None = None):
        self.dir = Path(tempfile.mkdtemp(prefix="harness-zygote-"))
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc: subprocess.Popen | ForkedRank
        try:
            if from_server is not None:
                self.proc = from_server.fork_server(preload, theirs.fileno(), self.dir)
            else:
                env = {**os.environ, "PYTHONPATH": import_path(), "PYTHONUNBUFFERED": "1", **CPU_RANK_ENV}  # gloo's
                with open(self.dir / "zygote.log", "ab") as log:
                    self.proc = subprocess.Popen(
                        [sys.executable, "-m", "harness.launch.zygote", str(theirs.fileno()), str(self.dir),
                         ",".join(preload)],
                        pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                        env=env, start_new_session=True, preexec_fn=functools.partial(die_with_parent, os.getpid()))
        except BaseException:
            ours.close()
            shutil.rmtree(self.dir, ignore_errors=True)
            raise
        finally:
            theirs.close()
        self.sock = ours
        self.ready: bool | None = None  # None: not heard from yet

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_ready(self) -> bool:
        """Block until the server has imported what it preloads; False when it died instead."""
        if self.ready is None:
            readable, _, _ = select.select([self.sock], [], [], READY_TIMEOUT_S)
            msg = self.sock.recv(4096) if readable else b""
            self.ready = bool(msg) and json.loads(msg).get("ready", False)
        return self.ready

    def fork(self, argv: list[str], env: dict[str, str], log: Path, stdin) -> ForkedRank:
        """A rank running `harness.launch.worker ARGV` with env, in this process's current directory."""
        ours = theirs = None
        if stdin == subprocess.PIPE:
            theirs, ours = os.pipe()
        try:
            request = json.dumps({"argv": argv, "env": env, "cwd": os.getcwd(), "log": str(log)}).encode()
            socket.send_fds(self.sock, [request], [theirs] if theirs is not None else [])
            pid = json.loads(self.sock.recv(4096))["pid"]
        finally:
            if theirs is not None:
                os.close(theirs)
        return ForkedRank(pid, self.dir / str(pid), os.fdopen(ours, "wb") if ours is not None else None, self)

    def fork_server(self, preload: tuple[str, ...], fd: int, directory: Path) -> ForkedRank:
        """A fork server forked from this one that imports `preload` too, serving on the socket `fd`."""
        request = json.dumps({"serve": list(preload), "dir": str(directory),
                              "log": str(directory / "zygote.log")}).encode()
        socket.send_fds(self.sock, [request], [fd])
        pid = json.loads(self.sock.recv(4096))["pid"]
        return ForkedRank(pid, self.dir / str(pid), None, self)

    def close(self) -> None:
        self.sock.close()  # the server exits on EOF (its ranks die with it); still importing, it is killed
        try:
            self.proc.wait(timeout=5 if self.ready else 0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


# One fork server per preload: the one every pool's ranks and most cases fork from (no extra modules), and one per
# suite whose cases each fork ranks of their own and import more (refit: transformers, 2.5 s a rank), or engine whose
# ranks do (megatron-bridge). Ranks of other suites do not carry those modules, so no figure depends on which suite ran
# before it in this process. A server of more modules is forked from the first one, which has imported torch and
# megatron-core (4-5 s of CPU a server on a quiet 2-core x86 VM): it imports only its own.
_ZYGOTES: dict[tuple[str, ...], Zygote] = {}
_FAILED = False  # one that did not start is not tried again by this process


def prestart(backend: Backend, preload: tuple[str, ...] = ()) -> None:
    """Start the zygote's imports now, beside what the run does before its first case (a resolved backend)."""
    if enabled(backend) and preload not in _ZYGOTES:
        _ZYGOTES[preload] = _start(preload)


def get(preload: tuple[str, ...] = ()) -> Zygote | None:
    """The process's zygote of this preload, started on first use (again if it died); None when it cannot start."""
    global _FAILED
    if _FAILED:
        return None
    server = _ZYGOTES.get(preload)
    if server is not None and not server.alive and server.ready:
        close(preload)
        server = None
    if server is None:
        server = _ZYGOTES[preload] = _start(preload)
    if not server.wait_ready():
        log = (server.dir / "zygote.log").read_text(errors="replace").strip().splitlines()[-1:]
        print(f"harness: the rank fork server did not start ({' '.join(log) or 'no output'}); "
              "starting ranks with exec", file=sys.stderr)
        close()
        _FAILED = True
        return None
    return server


def _start(preload: tuple[str, ...]) -> Zygote:
    """A server of this preload: forked from the first server where that one runs (or can start), else afresh."""
    base = get() if preload else None
    if base is not None:
        try:
            return Zygote(preload, from_server=base)
        except (OSError, ValueError):  # the first server died under us: this one starts afresh
            close(())
    return Zygote(preload)


def close(preload: tuple[str, ...] | None = None) -> None:
    """Close the zygote of this preload, or every one (None)."""
    for key in list(_ZYGOTES) if preload is None else [preload]:
        server = _ZYGOTES.pop(key, None)
        if server is not None:
            server.close()


def pid(preload: tuple[str, ...] = ()) -> int | None:
    """The zygote's process id while it runs (it is no rank)."""
    server = _ZYGOTES.get(preload)
    return server.proc.pid if server is not None and server.alive else None


atexit.register(close)


# -- the server ---------------------------------------------------------------------------------------
def serve(sock: socket.socket, status_dir: Path, preload: tuple[str, ...] = ()) -> None:
    import_modules(PRELOAD, on_cpu=True)
    import_modules(MEGATRON, on_cpu=True, optional=True)
    import_modules(preload, on_cpu=True, optional=True)
    import gc

    # What the imports made is never garbage: out of every later collection (each rank's, case after case) and
    # out of the pages a collection would write to in every forked rank.
    gc.collect()
    gc.freeze()
    sock.send(json.dumps({"ready": True}).encode())
    zygote_pid = os.getpid()
    while True:
        readable, _, _ = select.select([sock], [], [], 0.05)
        _reap(status_dir)
        if not readable:
            continue
        try:
            msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 1)
        except OSError:
            return
        if not msg:
            return  # the harness closed its end (or died)
        request = json.loads(msg)
        if "serve" in request:  # a server of more modules, forked from this one (Zygote.fork_server)
            child = os.fork()
            if child == 0:
                _become_server(request, fds, sock, parent=zygote_pid)
            for fd in fds:
                os.close(fd)
            (status_dir / str(child)).unlink(missing_ok=True)
            sock.send(json.dumps({"pid": child}).encode())
            continue
        started_r, started_w = os.pipe()
        child = os.fork()
        if child == 0:
            os.close(started_r)
            _become_rank(request, fds, sock, started_w, parent=zygote_pid)
        os.close(started_w)
        for fd in fds:
            os.close(fd)
        # Answer once the child is in its own session (EOF): from then on killpg(pid) reaches it, as with
        # a Popen(start_new_session=True) that has returned.
        os.read(started_r, 1)
        os.close(started_r)
        # Exit statuses are written only in _reap, on this thread: a stale file of a reused pid goes first.
        (status_dir / str(child)).unlink(missing_ok=True)
        sock.send(json.dumps({"pid": child}).encode())


def _reap(status_dir: Path) -> None:
    while True:
        try:
            child, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if child == 0:
            return
        try:
            atomic_write(status_dir / str(child), str(os.waitstatus_to_exitcode(status)))
        except OSError:
            pass  # the harness is gone and took the directory with it


def _become_server(request: dict, fds: list[int], sock: socket.socket, parent: int) -> None:
    """In the forked child: become a fork server that imports request["serve"] too; never returns."""

    def body() -> int:
        sock.close()
        die_with_parent(parent)
        _log_to(request["log"])
        serve(socket.socket(fileno=fds[0]), Path(request["dir"]), tuple(request["serve"]))
        return 0

    _run_child(body)


def _become_rank(request: dict, fds: list[int], sock: socket.socket, started: int, parent: int) -> None:
    """In the forked child: become the rank the harness asked for; never returns."""

    def body() -> int:
        sock.close()
        os.setsid()
        die_with_parent(parent)
        os.close(started)
        os.dup2(fds[0] if fds else os.open(os.devnull, os.O_RDONLY), 0)
        _log_to(request["log"])
        os.environ.clear()
        os.environ.update(request["env"])
        # As an exec'd `python -m` would see it: the harness's directory first, then its PYTHONPATH.
        os.chdir(request["cwd"])
        extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
        sys.path[:1] = [request["cwd"], *extra]
        tempfile.tempdir = None  # TMPDIR of the rank, not of the zygote
        worker._T0 = time.time()
        return worker.main(request["argv"]) or 0

    _run_child(body)


def _log_to(path: str) -> None:
    """stdout and stderr appended to `path`."""
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)


def _run_child(body: Callable[[], int]) -> None:
    """In a forked child: run body and exit with its code (1 where it raised, the traceback printed); never returns
    into the server loop."""
    code = 1
    try:
        code = body()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except BaseException:  # noqa: BLE001 - the child must never return into the server loop
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])), Path(sys.argv[2]),
          tuple(m for m in (sys.argv[3] if len(sys.argv) > 3 else "").split(",") if m))
    os._exit(0)  # tearing down torch and megatron-core would cost the harness's exit a second
