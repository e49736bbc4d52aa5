"""The fork server of CPU ranks (harness/launch/zygote.py): a forked rank is the rank the harness asked for -
its environment, directory and temporary directory of the moment, its own session - exec is still there
(HARNESS_FORK_RANKS=0, NCCL), and a fork server that does not start falls back to exec with a message."""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import tempfile

import pytest

from harness.launch import run_case, zygote
from harness.models import load_model
from harness.spec import Case, CaseOptions, Layout
from tests.plants import fake_suites as fs

pytestmark = pytest.mark.usefixtures("no_leftover_ranks")


class Where:
    """Reports what the rank sees."""

    name = "where"
    imports: tuple[str, ...] = ()

    def rank_work(self, case, ctx):
        return {"cwd": os.getcwd(), "mark": os.environ.get("HARNESS_TEST_MARK"), "tmp": tempfile.gettempdir(),
                "path0": sys.path[0], "ppid": os.getppid(), "own_session": os.getsid(0) == os.getpid()}


def _where(world: int = 2):
    res = run_case(Case("tests.test_zygote:Where", load_model("tiny"), Layout(dp=world), "mcore", CaseOptions(), "gloo",
                        fs.CASE_TIMEOUT_S))
    assert res.status == "ok", res.error
    return [r.data for r in res.ranks]


@pytest.mark.slow
@pytest.mark.parametrize("fork", ["1", "0"])
def test_a_rank_sees_the_environment_and_directory_of_the_moment_it_was_asked_for(fork, tmp_path, monkeypatch):
    zygote.get()  # a fork server started before the changes below: a forked rank must not see its start-up state
    monkeypatch.setenv("HARNESS_FORK_RANKS", fork)
    monkeypatch.setenv("HARNESS_TEST_MARK", tmp_path.name)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    ranks = _where()
    parent = zygote.pid() if fork == "1" else os.getpid()
    assert {r["ppid"] for r in ranks} == {parent}  # forked by the server, or exec'd by this process
    for r in ranks:
        assert (r["mark"], r["cwd"], r["tmp"], r["path0"]) == (tmp_path.name, str(tmp_path), str(tmp_path),
                                                               str(tmp_path)), r
        assert r["own_session"]  # the runner kills a rank's process group


@pytest.mark.slow
def test_a_fork_server_that_does_not_start_falls_back_to_exec(monkeypatch, capsys):
    zygote.close()
    monkeypatch.setattr(zygote, "_FAILED", False)
    monkeypatch.setattr(zygote, "READY_TIMEOUT_S", 0.0)  # not ready at once: as one that died importing
    ranks = _where()
    assert {r["ppid"] for r in ranks} == {os.getpid()}
    assert capsys.readouterr().err.count("harness: the rank fork server did not start") == 1  # tried once
    assert zygote.pid() is None  # the one that did not start is gone


@pytest.mark.slow
def test_a_fork_server_that_died_is_replaced():
    first = zygote.get()
    os.kill(first.proc.pid, signal.SIGKILL)
    first.proc.wait()
    ranks = _where()
    assert {r["ppid"] for r in ranks} == {zygote.pid()} and zygote.pid() != first.proc.pid
    # a server of more modules, forked from the first one, dies with it and is replaced, forked from the new one
    more = zygote.get(("tabnanny",))
    base = zygote.get()
    os.kill(base.proc.pid, signal.SIGKILL)
    base.proc.wait()
    more.proc.wait(timeout=10)
    case = Case("tests.test_zygote:Preloaded", load_model("tiny"), Layout(dp=2), "mcore", CaseOptions(), "gloo",
                fs.CASE_TIMEOUT_S)
    again = run_case(case, preload=("tabnanny",))
    assert again.status == "ok" and all(r.data["has"] for r in again.ranks), again.error
    assert {r.data["ppid"] for r in again.ranks} == {zygote.pid(("tabnanny",))} != {more.proc.pid}
    assert _parent_of(zygote.pid(("tabnanny",))) == zygote.pid() != base.proc.pid


CALLED = False  # set by mark_called in the process that imported this module


def mark_called() -> None:
    global CALLED
    CALLED = True


class ImportsInRanksEngine:
    """An engine factory whose ranks import tabnanny and this module, calling mark_called (ImportsInRanks)."""

    rank_imports = ("tabnanny", "tests.test_zygote:mark_called")


class Preloaded:
    """Reports whether a module its suite would import is there before the rank imports anything."""

    name = "preloaded"
    imports: tuple[str, ...] = ()

    def rank_work(self, case, ctx):
        return {"has": "tabnanny" in sys.modules, "called": CALLED, "ppid": os.getppid()}


@pytest.mark.slow
def test_a_suites_own_imports_come_from_a_fork_server_of_their_own():
    """Ranks forked per case of a suite that imports more (refit: transformers) start with it imported, from a fork
    server of that preload; the ranks of the others (pools, other suites) do not carry it."""
    case = Case("tests.test_zygote:Preloaded", load_model("tiny"), Layout(dp=2), "mcore", CaseOptions(), "gloo",
                fs.CASE_TIMEOUT_S)
    plain, preloaded = run_case(case), run_case(case, preload=("tabnanny",))
    assert plain.status == preloaded.status == "ok", plain.error + preloaded.error
    assert not any(r.data["has"] for r in plain.ranks) and all(r.data["has"] for r in preloaded.ranks)
    assert {r.data["ppid"] for r in preloaded.ranks} == {zygote.pid(("tabnanny",))}
    assert {r.data["ppid"] for r in plain.ranks} == {zygote.pid()} != {zygote.pid(("tabnanny",))}
    # forked from the first server, which had imported torch and megatron-core: it imported tabnanny alone
    assert _parent_of(zygote.pid(("tabnanny",))) == zygote.pid()


def _parent_of(pid: int | None) -> int:
    assert pid is not None
    return int(open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[1])


@pytest.mark.slow
def test_an_engines_own_imports_come_from_the_fork_server_of_its_pool():
    """A pooled run of an engine whose ranks import packages of their own (megatron-bridge) forks its pool's ranks
    from a server that imported them, and called the `module:function` entries; a pool of other engines does not."""
    from harness.backends import Backend
    from harness.driver import LocalRanks
    from harness.planning import Plan

    case = Case("tests.test_zygote:Preloaded", load_model("tiny"), Layout(dp=2), "tests.test_zygote:ImportsInRanksEngine",
                CaseOptions(), "gloo", fs.CASE_TIMEOUT_S)
    ranks = LocalRanks(Plan(Preloaded(), None, [case], "tiny", 2, Backend.GLOO, case.engine))
    assert ranks.preload == ImportsInRanksEngine.rank_imports
    own = ranks.run(case)
    assert own.status == "ok", own.error
    assert all(r.data["has"] and r.data["called"] for r in own.ranks)
    assert {r.data["ppid"] for r in own.ranks} == {zygote.pid(ranks.preload)}
    mcore = dataclasses.replace(case, engine="mcore")
    plain = LocalRanks(Plan(Preloaded(), None, [mcore], "tiny", 2, Backend.GLOO, "mcore"))
    assert plain.preload == ()
    other = plain.run(mcore)
    assert other.status == "ok" and not any(r.data["has"] or r.data["called"] for r in other.ranks), other.error
