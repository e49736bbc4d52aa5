"""Warm rank pools: cases reuse ranks, results equal fresh ranks, failures and leaks retire the pool."""

from __future__ import annotations

import re

import pytest

from harness.driver import run_suite
from harness.launch.pool import RankPool
from harness.models import load_model
from harness.spec import Case, CaseOptions, Layout
from tests.plants import fake_suites as fs

pytestmark = pytest.mark.usefixtures("no_leftover_ranks")


def fake(mode: int, timeout_s: float = fs.CASE_TIMEOUT_S) -> Case:
    return Case("tests.plants.fake_suites:Misbehave", load_model("tiny"), Layout(dp=2), "mcore",
                CaseOptions(seed=mode), "gloo", timeout_s)


@pytest.mark.slow
def test_failed_case_retires_the_pool_and_the_next_gets_fresh_ranks():
    pool = RankPool(2, "gloo")
    try:
        first = pool.run(fake(fs.OK))
        second = pool.run(fake(fs.OK))
        assert first.ok and second.ok
        assert first.fresh_ranks and not second.fresh_ranks
        assert [r.data["pid"] for r in first.ranks] == [r.data["pid"] for r in second.ranks]
        bad = pool.run(fake(fs.RAISE))
        assert bad.status == "error" and "rank 1 failed in phase 'work'" in bad.error
        # the failed rank reported without a teardown (on NCCL one can wait forever on its failed peers)
        assert [("teardown" in r.timings) for r in sorted(bad.ranks, key=lambda r: r.rank)] == [True, False]
        hung = pool.run(fake(fs.HANG_COLLECTIVE, timeout_s=8))  # includes the fresh ranks' start-up: forked
        assert hung.fresh_ranks and hung.status == "timeout" and "rank 1 in 'work'" in hung.error
        after = pool.run(fake(fs.OK))
        assert after.ok and after.fresh_ranks
        assert pool.starts == 3
    finally:
        pool.close()


@pytest.mark.slow
def test_a_gloo_rank_runs_one_thread_starts_no_openmp_pool_and_stays_warm():
    """A gloo rank runs ATen on one thread (harness/platform/backend.py): parallel ops and large all-gathers start
    no OpenMP pool in it or in its gloo threads, and the next case keeps the rank. A case that gives it a second
    thread (the plant) leaves that setting and the pool of its main thread, and retires the ranks."""
    pool = RankPool(1, "gloo")
    try:
        runs = [pool.run(Case("tests.plants.fake_suites:Misbehave", load_model("tiny"), Layout(), "mcore",
                              CaseOptions(seed=mode), "gloo", fs.CASE_TIMEOUT_S))
                for mode in (fs.PARALLEL_OP, fs.LARGE_GATHERS, fs.TWO_THREADS, fs.OK)]
        assert all(r.ok for r in runs), [r.error for r in runs]
        assert [r.ranks[0].data["intra_op_threads"] for r in runs] == [1, 1, 1, 1]
        assert not runs[0].notes and not runs[1].notes, runs[0].notes + runs[1].notes
        assert not runs[1].fresh_ranks and runs[1].ranks[0].data["pid"] == runs[0].ranks[0].data["pid"]
        note = " ".join(runs[2].notes)
        assert "intra-op threads: 1 -> 2" in note, note
        assert re.search(r"; threads: \d+ -> \d+ \(new: ", note), note  # the pool of the thread that ran an op
        assert runs[3].fresh_ranks
    finally:
        pool.close()


_GATHERS = """
import sys, torch, torch.distributed as dist
from harness.launch import isolation
dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1], 1), rank=0, world_size=1)
torch.set_num_threads(int(sys.argv[2]))
isolation.start_lazy_threads()
before = isolation.snapshot()
for _ in range(10):
    dist.all_gather([torch.empty(1 << 20)], torch.ones(1 << 20))
print(isolation.leaks(before, isolation.snapshot()), flush=True)
# gloo's threads joined before the interpreter exits: left to exit, a thread still joinable aborted the process
# ("terminate called without an active exception", once beside a one-core load)
dist.destroy_process_group()
"""


@pytest.mark.slow  # starts an interpreter that imports torch and megatron (seconds each)
@pytest.mark.parametrize("threads", [1, 2])
def test_gloo_threads_start_openmp_pools_only_where_aten_has_more_than_one_thread(tmp_path, threads):
    """Why a gloo rank runs one thread: each gloo thread that copies an all-gather's output starts an OpenMP pool
    of its own when ATen has more than one thread (2: the plant), for the thread's life; on one, none starts."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _GATHERS, str(tmp_path / "store"), str(threads)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    leaked = out.stdout.strip().splitlines()[-1]
    if threads == 1:
        assert leaked == "[]"
    else:
        assert re.fullmatch(r"\['threads: (\d+) -> (\d+) \(new: pt_gloo_runloop( x2)?; a process group or pool "
                            r"the case made outlived it\)'\]", leaked), leaked


@pytest.mark.slow
def test_leaking_case_is_detected_and_the_pool_recovers():
    """A case leaves megatron's param all-gather patched; the next case must not inherit it."""
    pool = RankPool(2, "gloo")
    tiny = load_model("tiny")
    opts = CaseOptions(steps=3, use_distributed_optimizer=True)
    try:
        leaky = pool.run(Case("grad-sync", tiny, Layout(dp=2), "tests.plants.faulty_engines:SkipParamAllGather", opts))
        assert leaky.ok
        assert any("_ParamAndGradBucketGroup.start_param_sync was replaced and not restored" in n for n in leaky.notes)
        clean = pool.run(Case("grad-sync", tiny, Layout(dp=2), "mcore", opts))
        assert clean.fresh_ranks and not clean.notes
        from harness.suite_defs.grad_sync import GradSyncSuite

        checks = {c.check: c for c in GradSyncSuite().check([clean])}
        assert checks["grad-sync.plan"].passed, checks["grad-sync.plan"].message
    finally:
        pool.close()


@pytest.mark.slow
def test_warm_ranks_keep_their_threads_and_a_kept_group_retires_the_pool():
    """Case after case a warm rank ends with the threads it had: megatron 0.16's lru_cache on
    RotaryEmbedding.forward kept every finished case's rotary module and its CP group (three gloo threads
    each: +3 threads per case) until the teardown cleared megatron's caches. A case that keeps a group
    alive itself is a leak: the pool is retired and the next case gets fresh ranks."""
    pool = RankPool(2, "gloo")
    tiny = load_model("tiny")
    opts = CaseOptions(steps=1)
    try:
        runs = [pool.run(Case("grad-sync", tiny, Layout(dp=2), "mcore", opts)) for _ in range(3)]
        assert all(r.ok and not r.notes for r in runs), [r.notes for r in runs]
        threads = [[r.memory.threads for r in run.ranks if r.memory] for run in runs]
        assert threads[0] == threads[1] == threads[2], threads
        kept = pool.run(Case("grad-sync", tiny, Layout(dp=2), "tests.plants.faulty_engines:KeepsGroupAlive", opts))
        assert kept.ok
        assert any(re.search(r"left threads: \d+ -> \d+ \(new: [^;]*pt_gloo_runloop[^;]*; a process group or pool "
                             r"the case made outlived it\)", n)
                   for n in kept.notes), kept.notes
        after = pool.run(Case("grad-sync", tiny, Layout(dp=2), "mcore", opts))
        assert after.ok and after.fresh_ranks and not after.notes
    finally:
        pool.close()


def _values(run):
    out = []
    for r in run.results:
        out.append((r.case.id, r.status, run.suite.metrics(r)))
    return out, [(c.check, c.case_id, c.passed, c.value) for c in run.checks]


@pytest.mark.slow
# grad-sync's twin runs nightly: equivalence's TP 2 case shows a warm rank's history moving a value
@pytest.mark.parametrize("suite", ["equivalence", pytest.param("grad-sync", marks=pytest.mark.nightly)])
def test_shuffled_warm_ranks_give_the_same_verdicts_and_values(suite):
    layouts = ["tp2-pp1-cp1-dp1"] if suite == "equivalence" else ["tp1-pp1-cp1-dp2"]
    fresh = run_suite(suite, "tiny", 2, layouts, backend="gloo", fresh_ranks=True)
    warm = run_suite(suite, "tiny", 2, layouts, backend="gloo", shuffle_seed=3)
    assert any(not r.fresh_ranks for r in warm.results)
    f_cases, f_checks = _values(fresh)
    w_cases, w_checks = _values(warm)
    assert f_cases == w_cases
    assert f_checks == w_checks  # verdicts and judged values (equivalence errors) bit-identical


@pytest.mark.parametrize("suite", ["step-perf", "train-memory", "ckpt-memory"])
def test_a_timing_or_memory_suite_gets_ranks_that_ran_no_other_suite(monkeypatch, suite):
    """The suites whose figures a rank's history moves (fresh_pool) retire warm ranks that ran another suite before
    them, and keep their own warm ones."""
    from harness.launch import pool as pool_mod
    from harness.suite_defs import FreshRanks, get_suite

    found = get_suite(suite)
    assert isinstance(found, FreshRanks) and found.fresh_pool
    closed = []
    monkeypatch.setattr(pool_mod.RankPool, "close", lambda self, **kw: closed.append(self.world_size))
    monkeypatch.setattr(pool_mod, "_POOLS", {})
    other, own = pool_mod.pool_for(4, "gloo"), pool_mod.pool_for(2, "gloo")
    other.suites, own.suites = {suite, "peft-ckpt"}, {suite}
    pool_mod.retire_pools_used_by_others(suite)
    assert closed == [4] and other.retired == [f"ran peft-ckpt before {suite}"]
    assert pool_mod.pool_for(2, "gloo") is own and pool_mod.pool_for(4, "gloo") is not other


@pytest.mark.slow
def test_a_suite_whose_figures_a_ranks_history_moves_gets_fresh_ranks_for_every_case():
    """ckpt-memory's save peaks moved with the cases a warm rank had run (harness/suite_defs/ckpt_memory/suite.py):
    such a suite's every case runs on ranks of its own; others keep their warm ranks."""
    from harness.suite_defs import FreshRanksPerCase, get_suite

    assert isinstance(get_suite("ckpt-memory"), FreshRanksPerCase)
    per_case = run_suite("tests.fakes.toy_suite:ToySuiteRanksPerCase", "tiny", 2, backend="gloo")
    warm = run_suite("tests.fakes.toy_suite:ToySuite", "tiny", 2, backend="gloo")
    assert per_case.passed and warm.passed
    assert [r.fresh_ranks for r in per_case.results] == [True, True]
    assert [r.fresh_ranks for r in warm.results][1:] == [False]


class ImportsTabnanny:
    """Reports how many objects the collector has frozen in the rank, then imports a module the ranks do not have."""

    name = "imports-tabnanny"
    imports: tuple[str, ...] = ()

    def rank_work(self, case, ctx):
        import gc
        import tabnanny  # noqa: F401

        return {"frozen": gc.get_freeze_count()}


@pytest.mark.slow
def test_what_a_case_imported_is_out_of_the_collectors_sight_in_the_next():
    """A warm rank freezes what it holds for its life after a case that imported modules (a full collection per case
    then scans the case's objects only); after a case that imported nothing it freezes nothing more."""
    pool = RankPool(1, "gloo")
    try:
        case = Case("tests.test_pool:ImportsTabnanny", load_model("tiny"), Layout(), "mcore", CaseOptions(), "gloo",
                    fs.CASE_TIMEOUT_S)
        runs = [pool.run(case) for _ in range(3)]
        assert all(r.ok for r in runs) and not any(r.fresh_ranks for r in runs[1:]), [r.error for r in runs]
        first, second, third = (r.ranks[0].data["frozen"] for r in runs)
        assert first < second >= third, (first, second, third)  # (frozen objects are still freed when unreferenced)
    finally:
        pool.close()
