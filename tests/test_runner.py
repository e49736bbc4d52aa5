"""The local runner: results as data, per-case timeout, failing / dying / hanging ranks, no orphans."""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
import time

import psutil
import pytest

from harness.launch import run_case, zygote
from harness.launch.children import die_with_parent
from harness.models import load_model
from harness.spec import Case, CaseOptions, Layout
from tests.plants import fake_suites as fs
from tests.conftest import live_worker_pids

pytestmark = pytest.mark.usefixtures("no_leftover_ranks")
SUITE = "tests.plants.fake_suites:Misbehave"


def case(mode: int, timeout_s: float = fs.CASE_TIMEOUT_S, world: int = 2) -> Case:
    return Case(SUITE, load_model("tiny"), Layout(dp=world), "mcore", CaseOptions(seed=mode), "gloo", timeout_s)


@pytest.mark.slow
def test_ok_case_returns_rank_data_and_timings():
    res = run_case(case(fs.OK))
    assert res.status == "ok", res.error
    assert [r.data["sum"] for r in res.ranks] == [3.0, 3.0]  # 1 + 2, all-reduced over gloo
    for phase in ("rank_start", "imports", "init", "work"):
        assert phase in res.timings(), phase
    assert "teardown" not in res.timings()  # a rank of one case ends with it: nothing is torn down
    assert all(not psutil.pid_exists(r.data["pid"]) for r in res.ranks)


@pytest.mark.slow
def test_raising_rank_is_named_with_its_traceback():
    t0 = time.monotonic()
    res = run_case(case(fs.RAISE))
    assert res.status == "error"
    assert "rank 1 failed in phase 'work'" in res.error
    assert "RuntimeError: planted failure on rank 1" in res.error
    assert time.monotonic() - t0 < fs.CASE_TIMEOUT_S / 2  # the peer blocked in a collective is stopped, not waited for


@pytest.mark.slow
@pytest.mark.parametrize("mode,reason", [(fs.EXIT, "exit code 3"), (fs.SIGKILL, "killed by SIGKILL")])
def test_dying_rank_is_named(mode, reason):
    res = run_case(case(mode))
    assert res.status == "error"
    assert f"rank 1 died ({reason}) in phase 'work'" in res.error, res.error


@pytest.mark.slow
def test_hanging_rank_ends_the_case_within_the_timeout():
    zygote.get()  # the timeout includes the ranks' start-up: forked ones, once the fork server has imported
    t0 = time.monotonic()
    res = run_case(case(fs.HANG_COLLECTIVE, timeout_s=8))
    wall = time.monotonic() - t0
    assert res.status == "timeout"
    assert "timed out after 8s" in res.error
    assert "rank 1 in 'work'" in res.error
    assert "time.sleep" in res.error or "fake_suites.py" in res.error  # the hung rank's stack
    assert wall < 8 + 15


@pytest.mark.slow
def test_consecutive_cases_do_not_collide():
    results = [run_case(case(fs.OK)) for _ in range(3)]
    assert [r.status for r in results] == ["ok"] * 3, [r.error for r in results]


@pytest.mark.slow  # starts an interpreter that imports torch and megatron (seconds each)
def test_ranks_die_with_a_killed_parent():
    code = ("from tests.test_runner import case; from harness.launch import run_case; "
            "from tests.plants import fake_suites as fs; run_case(case(fs.SLEEP, timeout_s=600))")
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 300  # its fork server imports torch first
        while time.monotonic() < deadline:
            kids = [p for p in psutil.Process(parent.pid).children(recursive=True)]
            if len(kids) >= 2:
                break
            time.sleep(0.2)
        assert len(kids) >= 2, "the parent did not start its ranks"
    finally:
        parent.kill()
        parent.wait()
    gone, alive = psutil.wait_procs(kids, timeout=15)
    assert not alive, f"orphan ranks after the parent died: {[p.pid for p in alive]}"
    assert not live_worker_pids()


def test_a_rank_whose_parent_died_before_prctl_kills_itself():
    # The race behind an orphan: the parent dies after fork, before the child's PR_SET_PDEATHSIG.
    # The child sees a parent pid that is not the one that spawned it and must not run on.
    code = [sys.executable, "-c", "pass"]
    assert subprocess.Popen(code, preexec_fn=functools.partial(die_with_parent, os.getpid())).wait(10) == 0
    gone = subprocess.Popen(code, preexec_fn=functools.partial(die_with_parent, os.getpid() + 10**6))
    assert gone.wait(10) == -signal.SIGKILL


@pytest.mark.slow
def test_torchrun_entry_runs_a_suite_in_process(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    proc = subprocess.run(
        [*torchrun, "-m", "harness.torchrun", "--suite", "equivalence", "--model", "tiny",
         "--layout", "tp2-pp1-cp1-dp1", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # reference: finite, replicas; tp2: finite, replicas, loss, log-probs, params
    assert "equivalence: 7 checks passed, 0 failed" in proc.stdout
    assert (tmp_path / "results.json").exists()


@pytest.mark.slow
@pytest.mark.nightly
def test_torchrun_entry_at_world_size_1_judges_step_perf(tmp_path):
    """One rank under torchrun (a one-GPU node's shape, here on gloo): step-perf runs and is judged - against
    an empty baselines directory, so the verdict is the missing baseline with the command that records it."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    proc = subprocess.run(
        [*torchrun, "-m", "harness.torchrun", "--suite", "step-perf", "--model", "tiny", "--backend", "gloo",
         "--baselines-dir", str(tmp_path / "baselines"), "--out", str(tmp_path / "out"), "--timed-steps", "3"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "step-perf: 0 checks passed, 8 failed (4 cases" in proc.stdout, proc.stdout[-3000:]
    assert ("record it with: harness baselines record --suite step-perf --model tiny --world-size 1 --layout "
            "tp1-pp1-cp1-dp1 --backend gloo") in proc.stdout
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert data["world_size"] == 1 and [c["outcome"] for c in data["cases"]] == ["regression"] * 4


@pytest.mark.slow
def test_torchrun_entry_stops_every_rank_when_the_environment_is_broken(tmp_path):
    """Under torchrun rank 0 finds the first cases all errored alike and every rank stops with it: exit 3."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    proc = subprocess.run(
        [*torchrun, "-m", "harness.torchrun", "--suite", "grad-sync", "--model", "tiny", "--backend", "gloo",
         "--engine", "tests.plants.faulty_engines:NeedsMissingModule", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[1],
    )
    # torchrun itself exits 1 when a rank exits non-zero, and names the rank's own code
    assert proc.returncode == 1 and re.search(r"exitcode\s*: 3 ", proc.stderr), proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "stopping after 3 of 16 cases: the first 3 cases all errored in phase 'build' with ModuleNotFoundError: " \
           "No module named 'harness_missing_framework'" in proc.stderr, proc.stderr[-3000:]
    data = json.loads((tmp_path / "results.json").read_text())
    assert [c["outcome"] for c in data["cases"]] == ["error"] * 3 and data["stopped"]


@pytest.mark.slow
@pytest.mark.parametrize("fork", ["1", "0"])
def test_gloo_ranks_see_no_gpu_on_a_gpu_node(monkeypatch, fork):
    """On a GPU node a gloo case (e.g. world size 4 on one GPU, where `auto` picks gloo) runs on CPU ranks:
    forked from the fork server or exec'd, a gloo rank has CUDA_VISIBLE_DEVICES emptied, whatever the
    harness's own environment shows; the CPU layer would refuse a process where CUDA is available."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("HARNESS_FORK_RANKS", fork)
    zygote.close()  # a fork server started now, with this environment
    res = run_case(case(fs.OK))
    assert res.status == "ok", res.error
    assert [r.data["cuda_visible"] for r in res.ranks] == ["", ""]
    if fork == "1":
        server = zygote.pid()
        assert server is not None
        env = dict(kv.split("=", 1) for kv in open(f"/proc/{server}/environ").read().split("\0") if "=" in kv)
        assert env["CUDA_VISIBLE_DEVICES"] == ""
    zygote.close()


@pytest.mark.slow
@pytest.mark.nightly
def test_torchrun_entry_gives_each_case_its_own_scratch_and_leaves_none(tmp_path):
    """Each case gets a directory of its own (a checkpoint saved by one case is not in the next case's, nor in the
    next run's, as it was in a fixed $TMPDIR), and the run's directory is gone after it."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    env = {**os.environ, "HARNESS_ARTIFACTS": str(tmp_path / "artifacts"), "TMPDIR": str(tmp_path)}
    for _ in range(2):  # the second run finds nothing of the first
        proc = subprocess.run(
            [*torchrun, "-m", "harness.torchrun", "--suite", "tests.plants.fake_suites:Scratch", "--model", "tiny",
             "--backend", "gloo", "--out", str(tmp_path / "out")],
            capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[1], env=env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "scratch: 2 checks passed, 0 failed" in proc.stdout, proc.stdout[-3000:]
    assert list((tmp_path / "artifacts").iterdir()) == []


def test_gpu_ranks_compile_in_their_own_process_unless_told_and_gloo_ranks_see_no_gpu(monkeypatch, tmp_path):
    """An NCCL rank's environment sets TORCHINDUCTOR_COMPILE_THREADS=1 (no compile worker process appearing in a
    warm rank at its first torch.compile); a user's own setting wins. A gloo rank sees no GPU."""
    from harness.launch.runner import rank_env

    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    nccl = Case(SUITE, load_model("tiny"), Layout(dp=2), "mcore", CaseOptions(), "nccl", fs.CASE_TIMEOUT_S)
    assert rank_env(nccl, 1, tmp_path)["TORCHINDUCTOR_COMPILE_THREADS"] == "1"
    gloo = rank_env(case(fs.OK), 1, tmp_path)
    assert gloo["CUDA_VISIBLE_DEVICES"] == "" and "TORCHINDUCTOR_COMPILE_THREADS" not in gloo
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "8")
    assert rank_env(nccl, 1, tmp_path)["TORCHINDUCTOR_COMPILE_THREADS"] == "8"


def test_a_pool_rank_that_failed_reports_without_a_teardown(monkeypatch, tmp_path):
    """A warm pool's rank exits after a failed case: it reports at once, with no teardown of megatron's groups to
    wait on (on NCCL destroying a group waits for operations its failed peers never match: a timeout without
    the traceback). A torchrun rank goes on to its next case and tears down (the plant: the pool's call
    without exits_on_failure)."""
    import sys

    from harness.launch.context import RankContext
    from harness.launch.worker import run_rank
    from harness.platform import parallel

    torn: list[str] = []
    monkeypatch.setattr(parallel, "teardown_parallel_state", lambda: torn.append("teardown"))
    monkeypatch.setitem(sys.modules, "megatron.core.parallel_state", sys.modules.get("megatron.core.parallel_state")
                        or object())
    failing = Case("tests.plants.fake_suites:Mixed", load_model("tiny"), Layout(dp=2), "mcore",
                   CaseOptions(seed=fs.ERROR), "gloo", fs.CASE_TIMEOUT_S)
    pool = run_rank(failing, RankContext(1, 2, 1, "gloo", tmp_path), own_process_group=False, exits_on_failure=True)
    assert not pool.ok and "planted failure on rank 1" in pool.error and torn == []
    torchrun = run_rank(failing, RankContext(1, 2, 1, "gloo", tmp_path), own_process_group=False)
    assert not torchrun.ok and torn == ["teardown"]
