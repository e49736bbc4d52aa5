"""ckpt-memory: the memory model, baselines, and planted host-memory regressions in the save path."""

from __future__ import annotations

import json
import re

import pytest

from harness import baselines
from harness.checks.memory_model import MIB, discrimination, gathers, project, rival, save_band
from harness.driver import run_suite
from harness.errors import BadInput
from harness.layouts import enumerate_layouts
from harness.models import load_model
from harness.spec import Layout


def _blind_spots(model, world_size: int, fmt: str = "dp_reshardable") -> set[tuple[str, int]]:
    """(layout, rank) of every valid layout of the world size where the fmt band overlaps its rival's."""
    out = set()
    for layout in enumerate_layouts(model, world_size):
        for rank in range(world_size):
            if fmt == "fully_reshardable_mem_efficient" and gathers(fmt, layout, rank):
                continue  # DP rank 0 of mem_efficient gathers like fully_reshardable: compared below as that
            mine = save_band(fmt, model, layout, rank)
            other = save_band(rival(fmt, layout, rank), model, layout, rank)
            assert mine.overlaps(other) == bool(discrimination(fmt, model, layout, rank))
            if mine.overlaps(other):
                out.add((layout.id, rank))
    return out


@pytest.mark.parametrize("world_size", [4, 2])
def test_small_separates_the_formats_wherever_there_is_dp_to_gather_over(world_size):
    """Every layout x rank of `small`: the dp_reshardable and fully_reshardable bands do not overlap, except
    where D = DP x CP = 1 (nothing to gather: both stage the whole 12N)."""
    small = load_model("small")
    no_dp = {(lay.id, r) for lay in enumerate_layouts(small, world_size) if lay.dp * lay.cp == 1
             for r in range(world_size)}
    assert no_dp  # tp2-pp2 / tp4 / pp4 / cp4 / ... at 4, tp2 / pp2 / cp2 at 2
    for fmt in ("dp_reshardable", "fully_reshardable"):
        assert _blind_spots(small, world_size, fmt) == no_dp, fmt
    # mem_efficient off DP rank 0 against fully_reshardable (at D = 1 every rank is a DP rank 0)
    assert _blind_spots(small, world_size, "fully_reshardable_mem_efficient") == set()
    why = discrimination("dp_reshardable", small, Layout.parse("tp2-pp2-cp1-dp1"), 0)
    assert why.startswith("cannot discriminate dp_reshardable from fully_reshardable at rank 0: D = DP x CP = 1")


@pytest.mark.parametrize("world_size", [4, 2])
def test_tiny_cannot_separate_the_formats_anywhere_and_says_why(world_size):
    """`tiny`'s whole optimizer state (12N = 0.47-0.94 MiB per shard) is below the 2 MiB fixed cost of a save."""
    tiny = load_model("tiny")
    every = {(lay.id, r) for lay in enumerate_layouts(tiny, world_size) for r in range(world_size)}
    assert _blind_spots(tiny, world_size) == every
    assert discrimination("dp_reshardable", tiny, Layout(dp=4), 1) == (
        "cannot discriminate dp_reshardable from fully_reshardable at rank 1 for this model: 12N = 0.94 MiB, the "
        "non-gathering bound 2.24 MiB (incl. fixed cost 2 MiB) reaches the gathered minimum 0.94 MiB")


def _committed_entries():
    """(key, metrics) of every stack's committed ckpt-memory file on CPU ranks."""
    files = sorted((baselines.DEFAULT_DIR / "cpu-gloo").glob("*/ckpt-memory.json"))
    assert files
    return [(k, m) for f in files for k, m in baselines.load(f)["entries"].items()]


def test_every_measured_point_of_the_committed_small_baseline_is_inside_its_band():
    """The bands were tightened to S/D (+P) + FIXED_COST: the recorded peaks of `small` must stay inside."""
    small, checked = load_model("small"), 0
    for key, metrics in _committed_entries():
        model, layout, fmt, *variant = key.split("/")
        if model != "small" or variant[-1:] in (["reshard"], ["reshard-load"]):
            continue  # the contract's loads: test_every_recorded_load_peak_of_small_is_inside_its_load_band
        fmt = {"default": "dp_reshardable", "fsdp2_default": "fsdp2_sharded"}.get(fmt, fmt)
        peaks: dict[int, float] = {}
        for name, m in metrics.items():
            if not name.endswith(("save_heap_peak_mib", "save_writer_peak_mib")):
                continue  # what later saves kept is not part of the save's peak
            rank = int(name.split(".")[0][len("rank"):])
            peaks[rank] = peaks.get(rank, 0.0) + m["value"]
        for rank, mib in peaks.items():
            band = save_band(fmt, small, Layout.parse(layout), rank, "fully-parallel" in variant)
            assert band.contains(int(mib * MIB)), f"{key} rank {rank}: {mib:.2f} MiB outside {band.describe()}"
            checked += 1
    assert checked >= 60  # 73 in the file recorded with this change


def test_every_recorded_load_peak_of_small_is_inside_its_load_band():
    """The contract's loads, baselined per rank (load-<layout>.rank<r>.host_peak_mib), inside the memory model's
    load band of their format and layout."""
    from harness.checks.memory_model import load_band

    small, checked = load_model("small"), 0
    for key, metrics in _committed_entries():
        model, _, fmt, role = (key.split("/") + [""])[:4]
        if model != "small" or role not in ("reshard", "reshard-load"):
            continue
        for name, m in metrics.items():
            target, rank, _ = name.split(".")
            band = load_band(fmt, small, Layout.parse(target.removeprefix("load-")), int(rank.removeprefix("rank")))
            assert band.contains(int(m["value"] * MIB)), f"{key} {name}: {m['value']:.1f} MiB outside {band.describe()}"
            checked += 1
    assert checked >= 10, checked


def test_projection_of_r1_at_70b():
    p = project("fully_reshardable", load_model("70b"), Layout.parse("tp8-pp2-cp1-dp16"), 8)
    assert p.per_rank_low / (1024 * MIB) > 40  # ~12N = 49 GiB per rank for a 70B TP8 x PP2 shard


def test_baselines_compare_missing_and_corrupt(tmp_path):
    path = tmp_path / "cpu-gloo" / "ckpt-memory.json"
    assert baselines.load(path) == {}
    entries = baselines.build_entries({"small/tp1-pp1-cp1-dp4/default": {"rank0.save_host_peak_mib": [30.0, 32.0, 30.5]}})
    assert entries["small/tp1-pp1-cp1-dp4/default"]["rank0.save_host_peak_mib"]["tolerance"] == 8.0  # 4 x spread
    diff = baselines.write(path, "ckpt-memory", "cpu-gloo", entries, {"torch": "x"})
    assert diff.startswith("+ small/tp1-pp1-cp1-dp4/default rank0.save_host_peak_mib: 30.5")
    data = baselines.load(path)
    key, metric = "small/tp1-pp1-cp1-dp4/default", "rank0.save_host_peak_mib"
    assert baselines.compare(data, key, metric, 38.0).status == "pass"
    assert baselines.compare(data, key, metric, 40.0).status == "regression"
    assert baselines.compare(data, key, metric, 20.0).status == "improvement"
    assert baselines.compare(data, "other", metric, 1.0).status == "missing"
    assert not list(path.parent.glob(".*"))  # no temporary file left behind
    path.write_text("{not json")
    with pytest.raises(BadInput, match=r"ckpt-memory.json is corrupt .*re-record it"):
        baselines.load(path)
    path.write_text(json.dumps({"entries": {"k": {"m": {"value": "x"}}}}))
    with pytest.raises(BadInput, match="corrupt"):
        baselines.load(path)


def _run(engine="mcore", formats=("default",), baselines_dir=None, model="small", **params):
    return run_suite("ckpt-memory", model, 4, ["tp1-pp1-cp1-dp4"], backend="gloo", engine=engine,
                     suite_params={"formats": formats, **params}, baselines_dir=baselines_dir)


def _failed(run, check):
    return [c for c in run.checks if c.check == check and c.failed]


@pytest.mark.slow
def test_missing_baseline_fails_with_the_record_command(tmp_path):
    run = _run(baselines_dir=str(tmp_path))
    (fail,) = _failed(run, "ckpt-memory.baseline")
    assert "no baseline for small/tp1-pp1-cp1-dp4/default rank0.save_heap_peak_mib on platform cpu-gloo (" in fail.message
    assert fail.message.endswith("record it with: harness baselines record --suite ckpt-memory --model small "
                                 "--world-size 4 --layout tp1-pp1-cp1-dp4 --backend gloo --distributed-optimizer "
                                 "--ckpt-format default")
    assert not _failed(run, "ckpt-memory.model") and not _failed(run, "ckpt-memory.contract")


@pytest.mark.slow
def test_r1_default_format_flip_fails_with_delta_and_flamegraph():
    run = _run(engine="tests.plants.faulty_engines:FullyReshardableDefault")
    (base,) = _failed(run, "ckpt-memory.baseline")
    assert "MiB above baseline" in base.message and "flamegraph: " in base.message
    flame = base.message.split("flamegraph: ")[1]
    assert flame.endswith(".html")
    (contract,) = _failed(run, "ckpt-memory.contract")
    assert contract.message.startswith("tests.plants.faulty_engines:FullyReshardableDefault default format (expected "
                                       "dp_reshardable): the checkpoint on disk is fully_reshardable, not "
                                       "dp_reshardable (")
    assert "per-parameter optimizer tensors with the parameters' global shapes" in contract.message
    (model,) = _failed(run, "ckpt-memory.model")  # judged against the expected format's band
    assert model.message.startswith("rank 0 save host peak ") and " MiB outside the dp_reshardable model band " \
        "[0.0, 42.3] MiB (dp_reshardable: <= S/D + P, S=12N, N=6.03M, D=4)" in model.message


@pytest.mark.slow
def test_extra_copy_of_ten_percent_of_optimizer_state_is_detected():
    run = _run(engine="tests.plants.faulty_engines:ExtraStateCopyOnSave", formats=("dp_reshardable",))
    fails = _failed(run, "ckpt-memory.baseline")
    assert fails and "MiB above baseline" in fails[0].message, [c.message for c in run.checks]


@pytest.mark.slow
def test_memory_every_save_leaves_behind_fails_naming_the_rank_the_bytes_per_save_and_where():
    """Kept after each save: the save's model band passes, the repeated saves and their baseline do not."""
    run = _run(engine="tests.plants.faulty_engines:KeepsAHostCopyOfEverySave", formats=("dp_reshardable",))
    (kept,) = _failed(run, "ckpt-memory.retained")
    # 10% of 12N of small (N = 6.03M) per save: 6.9 MiB, and megatron's own few KiB
    assert re.match(r"rank \d keeps (6\.9|7\.0) MiB per save: 2 saves of the same state left 1\d\.\d MiB allocated "
                    r"during them live after them \(bound 1 MiB per save\); most of it, 13\.8 MiB in \d+ allocations, "
                    r"from .*save_checkpoint faulty_engines\.py:\d+ .*; what stayed: \S+memray-resaves-rank\d\.html$",
                    kept.message), kept.message
    assert kept.captures.leaks and not _failed(run, "ckpt-memory.model")
    # and the baseline of what saves keep (recorded: 0.03 MiB per save, tolerance 0.5) shows it on every rank (the
    # check names the largest rise: the measured save's heap peak, which holds its own copy)
    (base,) = _failed(run, "ckpt-memory.baseline")
    kept_rows = [r for r in base.details if ".retained_per_save_mib:" in r]
    assert len(kept_rows) == 4 and all(re.match(r"rank\d\.retained_per_save_mib: (6\.9|7\.0)\d MiB, baseline 0\.0\d "
                                                r"\+- 0\.50, delta \+6\.\d\d MiB: regression", r) for r in kept_rows), \
        kept_rows


def test_what_saves_keep_is_judged_per_save_against_the_bound():
    from harness.launch.results import CaseResult, RankResult
    from harness.probes.memory import MemoryPeak
    from harness.probes.retention import Retention
    from harness.spec import Case, CaseOptions
    from harness.suite_defs.ckpt_memory import CkptCaseParams
    from harness.suite_defs.ckpt_memory.judge import RETAINED_PER_SAVE, check_retained
    from harness.suite_defs.ckpt_memory.payload import SaveRankData

    def run(per_save: list[float]) -> CaseResult:
        case = Case("ckpt-memory", load_model("tiny"), Layout(dp=len(per_save)), "mcore", CaseOptions(),
                    params=CkptCaseParams("dp_reshardable"))
        ranks = [RankResult(r, data=SaveRankData(MemoryPeak("save"), retention=Retention(
            3, int(3 * b), 10, [100 * MIB] * 4, f"/tmp/memray-resaves-rank{r}.bin", [("f x.py:1", int(3 * b), 10)])))
            for r, b in enumerate(per_save)]
        return CaseResult(case, ranks, "ok")

    ok = check_retained(run([40 * 1024, 230 * 1024]))
    assert ok.passed and ok.message == "every rank keeps at most 230 KiB per save (bound 1 MiB; rank 1)", ok.message
    bad = check_retained(run([40 * 1024, RETAINED_PER_SAVE + MIB]))
    assert bad.failed and bad.message.startswith("rank 1 keeps 2.0 MiB per save: 3 saves of the same state left "
                                                 "6.0 MiB allocated during them live after them"), bad.message
    assert bad.captures.flamegraph_of == "/tmp/memray-resaves-rank1.bin" and len(bad.captures.files) == 2


@pytest.mark.slow
def test_r5_fsdp2_full_state_dict_default_is_above_the_sharded_baseline():
    run = _run(engine="tests.plants.faulty_ckpt:FullStateDictDefault", formats=("fsdp2_default",))
    (base,) = _failed(run, "ckpt-memory.baseline")
    assert base.message.startswith("rank0.save_heap_peak_mib ") and "MiB above baseline" in base.message
    assert base.message.split("flamegraph: ")[1].endswith(".html")
    (contract,) = _failed(run, "ckpt-memory.contract")
    assert contract.message.startswith("tests.plants.faulty_ckpt:FullStateDictDefault default format (expected "
                                       "fsdp2_sharded): the checkpoint on disk is fsdp2_full, not fsdp2_sharded "
                                       "(one torch.save file full_state_dict.pt")


@pytest.mark.slow
def test_right_label_on_the_wrong_format_fails_the_contract():
    """The engines label the checkpoint with the format asked for and save another: the files decide."""
    run = _run(engine="tests.plants.faulty_ckpt:SavesDpReshardableAlways", formats=("fully_reshardable",), model="tiny")
    (contract,) = _failed(run, "ckpt-memory.contract")
    assert contract.message.startswith("format fully_reshardable: the checkpoint on disk is dp_reshardable, not "
                                       "fully_reshardable (3 flat optimizer buffers of 1 DP group(s), e.g. "
                                       "optimizer.distributed.dp_group_idx_0.")
    assert "label written by the engine: fully_reshardable (agrees; secondary: the files decide)" in contract.details
    run = _run(engine="tests.plants.faulty_ckpt:SavesFullLabelsSharded", formats=("fsdp2_sharded",), model="tiny")
    (contract,) = _failed(run, "ckpt-memory.contract")
    assert contract.message.startswith("format fsdp2_sharded: the checkpoint on disk is fsdp2_full, not fsdp2_sharded "
                                       "(one torch.save file full_state_dict.pt")


@pytest.mark.slow
def test_a_save_whose_heap_peak_cannot_be_measured_errors_with_the_reason():
    run = _run(engine="tests.plants.faulty_ckpt:DeletesMemrayCapture", formats=("dp_reshardable",), model="tiny")
    (res,) = run.results
    assert res.status == "error" and "MeasurementError: memray wrote no capture at " in res.error, res.error
    assert "the phase's heap peak was not measured" in res.error


def test_fsdp2_band_separates_full_from_sharded():
    small, dp4 = load_model("small"), Layout(dp=4)
    assert save_band("fsdp2_sharded", small, dp4, 0).high < save_band("fsdp2_full", small, dp4, 0).low


@pytest.mark.slow
@pytest.mark.nightly  # ckpt-memory.baseline's CI-tier plants: R1's format flip, a 10% extra copy
def test_fully_parallel_save_wrapper_dropped_is_detected():
    """Without the wrapper DP rank 0 writes all replicated weights again: ~29 MiB against ~12 MiB."""
    run = _run(engine="tests.plants.faulty_ckpt:DropsFullyParallelWrapper", formats=("dp_reshardable",),
               fully_parallel_save=True)
    (base,) = _failed(run, "ckpt-memory.baseline")
    assert base.case_id.endswith("fully_parallel_save=True]")
    assert re.match(r"rank0\.save_heap_peak_mib 2\d\.\d\d MiB is \+1\d\.\d\d MiB above baseline 12\.\d\d ", base.message), \
        base.message


def test_fully_parallel_band_spreads_the_weights():
    small, dp4 = load_model("small"), Layout(dp=4)
    assert save_band("dp_reshardable", small, dp4, 0, fully_parallel=True).high \
        < save_band("dp_reshardable", small, dp4, 0).high
    assert save_band("dp_reshardable", small, dp4, 1, fully_parallel=True).high \
        > save_band("dp_reshardable", small, dp4, 1).high
    assert save_band("fully_reshardable", small, dp4, 1, fully_parallel=True) == save_band("fully_reshardable", small, dp4, 1)


@pytest.mark.slow
@pytest.mark.nightly
def test_a_one_time_cost_of_the_first_save_lands_in_no_case(tmp_path, monkeypatch, no_leftover_ranks):
    """A first save that keeps 48 MiB for the process (tests/plants/faulty_ckpt.py; a GPU save's pinned blocks are
    such a cost) is paid in the case's priming save: no measured peak holds it, whichever case runs first
    on fresh ranks, and three runs in different orders give every case the same figures."""
    from harness.launch.pool import close_all
    from tests.plants.faulty_ckpt import ONE_TIME_MIB

    log = tmp_path / "paid"
    monkeypatch.setenv("HARNESS_ONE_TIME_LOG", str(log))
    figures: dict[str, list[dict[str, float]]] = {}
    for seed in (None, 1, 2):
        close_all()  # fresh rank processes: the first case of each run pays the one-time cost
        run = run_suite("ckpt-memory", "tiny", 2, ["tp1-pp1-cp1-dp2"], backend="gloo", shuffle_seed=seed,
                        engine="tests.plants.faulty_ckpt:OneTimeCostOnFirstSave",
                        suite_params={"formats": ("dp_reshardable", "fully_reshardable")})
        assert all(r.ok for r in run.results), "\n".join(r.error for r in run.results if not r.ok)
        for r in run.results:
            samples = run.suite.samples(r)
            assert max(samples.values()) < ONE_TIME_MIB / 4, (r.case.id, samples)
            figures.setdefault(r.case.id, []).append(samples)
    # paid once per rank process, and ckpt-memory runs every case on ranks of its own: 3 runs x 2 cases x 2 ranks
    assert len(log.read_text().split()) == 3 * 2 * 2
    # Whichever case ran first, its figures agree with the other orders' far below the planted cost. (Not within
    # a baseline's tolerance: a first measured save in a fresh process reads ~0.15 MiB more on rank 0, and
    # fully_reshardable's rank 1 reads 2.44 or 2.75 MiB from process to process - a quarter MiB that the
    # tolerance's floor of 0.25 MiB leaves no room for.)
    for case_id, runs in figures.items():
        for metric in runs[0]:
            values = [s[metric] for s in runs]
            assert max(values) - min(values) <= ONE_TIME_MIB / 16, (case_id, metric, values)


def test_two_runs_of_one_case_keep_their_memray_captures_apart(tmp_path, monkeypatch):
    """A suite run beside the tests (or two workers) may run the same case id at once: each run's captures live
    beside its own run directory, and the report stage keeps only what a failed check names."""
    from harness.checks import Captures, CheckResult
    from harness.driver import new_run_dir, with_outputs
    from harness.probes.memory import captures_dir, run_captures
    from harness.report.artifacts import finish
    from harness.spec import Case

    monkeypatch.setenv("HARNESS_ARTIFACTS", str(tmp_path))
    case = Case("ckpt-memory", load_model("small"), Layout(dp=4), "mcore")
    runs = [new_run_dir() for _ in range(2)]
    a, b = (captures_dir(with_outputs([case], run)[0]) for run in runs)
    assert a != b and a.parent == run_captures(runs[0]) and b.parent == run_captures(runs[1])
    assert run_captures(runs[0]).parent == tmp_path and not a.is_relative_to(runs[0])  # the run's deletion keeps it
    for d in (a, b):
        for name in ("memray-save-rank0.bin", "memray-save-rank1.bin", "memray-save-rank1.bin.123"):
            (d / name).write_bytes(b"x")
    passed = CheckResult("ckpt-memory.baseline", case.id, True, "ok", captures=Captures([str(a / "memray-save-rank0.bin")]))
    failed = CheckResult("ckpt-memory.baseline", case.id, False, "over", captures=Captures([str(b / "memray-save-rank1.bin")]))
    finish([passed], str(run_captures(runs[0])))
    assert not run_captures(runs[0]).exists()  # nothing failed: every capture and directory gone
    monkeypatch.setattr("harness.report.artifacts.render_flamegraph", lambda capture: "")
    finish([failed], str(run_captures(runs[1])))
    assert sorted(p.name for p in b.iterdir()) == ["memray-save-rank1.bin", "memray-save-rank1.bin.123"]
