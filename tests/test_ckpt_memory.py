"""ckpt-memory: the memory model, baselines, and planted host-memory regressions in the save path."""

from __future__ import annotations

import json

import pytest

from harness import baselines
from harness.checks.memory_model import MIB, project, save_band, shard_params
from harness.driver import run_suite
from harness.errors import BadInput
from harness.models import load_model
from harness.spec import CaseOptions, Layout


def test_model_separates_formats_and_projects_r1():
    small = load_model("small")
    dp4 = Layout(dp=4)
    assert shard_params(small, dp4, 0) == small.num_params()
    dp_res = save_band("dp_reshardable", small, dp4, 1)
    full = save_band("fully_reshardable", small, dp4, 1)
    assert dp_res.high < full.low  # the formats cannot be confused
    assert save_band("fully_reshardable_mem_efficient", small, dp4, 1).high < full.low
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


def _run(engine="mcore", formats=("default",), baselines_dir=None, **options):
    return run_suite("ckpt-memory", "small", 4, ["tp1-pp1-cp1-dp4"], backend="gloo", engine=engine,
                     ckpt_formats=list(formats), baselines_dir=baselines_dir, options=CaseOptions(**options))


def _failed(run, check):
    return [c for c in run.checks if c.check == check and not c.passed]


@pytest.mark.slow
def test_missing_baseline_fails_with_the_record_command(tmp_path):
    run = _run(baselines_dir=str(tmp_path))
    (fail,) = _failed(run, "ckpt-memory.baseline")
    assert "no baseline for small/tp1-pp1-cp1-dp4/default" in fail.message
    assert fail.message.endswith("record it with: harness baselines record --suite ckpt-memory --model small "
                                 "--world-size 4 --layout tp1-pp1-cp1-dp4 --ckpt-format default")
    assert not _failed(run, "ckpt-memory.model") and not _failed(run, "ckpt-memory.contract")


@pytest.mark.slow
def test_r1_default_format_flip_fails_with_delta_and_flamegraph():
    run = _run(engine="tests.faulty_engines:FullyReshardableDefault")
    (base,) = _failed(run, "ckpt-memory.baseline")
    assert "MiB above baseline" in base.message and "flamegraph: " in base.message
    flame = base.message.split("flamegraph: ")[1]
    assert flame.endswith(".html")
    (contract,) = _failed(run, "ckpt-memory.contract")
    assert "default format (expected dp_reshardable): checkpoint content metadata says fully_reshardable" \
        in contract.message


@pytest.mark.slow
def test_extra_copy_of_ten_percent_of_optimizer_state_is_detected():
    run = _run(engine="tests.faulty_engines:ExtraStateCopyOnSave", formats=("dp_reshardable",))
    fails = _failed(run, "ckpt-memory.baseline")
    assert fails and "MiB above baseline" in fails[0].message, [c.message for c in run.checks]


@pytest.mark.slow
def test_r5_fsdp2_full_state_dict_default_is_above_the_sharded_baseline():
    run = _run(engine="tests.faulty_ckpt:FullStateDictDefault", formats=("fsdp2_default",))
    (base,) = _failed(run, "ckpt-memory.baseline")
    assert base.message.startswith("rank0.save_heap_peak_mib ") and "MiB above baseline" in base.message
    assert base.message.split("flamegraph: ")[1].endswith(".html")
    (contract,) = _failed(run, "ckpt-memory.contract")
    assert "default format (expected fsdp2_sharded): checkpoint content metadata says fsdp2_full" in contract.message


def test_fsdp2_band_separates_full_from_sharded():
    small, dp4 = load_model("small"), Layout(dp=4)
    assert save_band("fsdp2_sharded", small, dp4, 0).high < save_band("fsdp2_full", small, dp4, 0).low


@pytest.mark.slow
def test_fully_parallel_save_wrapper_dropped_is_detected():
    """Without the wrapper DP rank 0 writes all replicated weights again: ~29 MiB against ~12 MiB."""
    run = _run(engine="tests.faulty_ckpt:DropsFullyParallelWrapper", formats=("dp_reshardable",),
               fully_parallel_save=True)
    (base,) = _failed(run, "ckpt-memory.baseline")
    assert base.case_id.endswith("fully_parallel_save=True]")
    assert base.message.startswith("rank0.save_heap_peak_mib ") and "MiB above baseline 11." in base.message


def test_fully_parallel_band_spreads_the_weights():
    small, dp4 = load_model("small"), Layout(dp=4)
    assert save_band("dp_reshardable", small, dp4, 0, fully_parallel=True).high \
        < save_band("dp_reshardable", small, dp4, 0).high
    assert save_band("dp_reshardable", small, dp4, 1, fully_parallel=True).high \
        > save_band("dp_reshardable", small, dp4, 1).high
    assert save_band("fully_reshardable", small, dp4, 1, fully_parallel=True) == save_band("fully_reshardable", small, dp4, 1)
