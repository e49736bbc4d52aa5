"""The checkpoint checks' judges on fabricated results, no ranks: NaN / Inf never pass, refusals must be
the load's own and of the expected kind, missing optimizer state fails, failed measurements raise, and
the checkpoint format is read from the files (not from the engine's label)."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import pytest
import torch

from harness import baselines
from harness.baselines import Source
from harness.checks.memory_model import FIXED_COST, MIB, save_band, shard_params
from harness.engines.base import ParamShard
from harness.launch.results import CaseResult, RankResult
from harness.models import load_model
from harness.probes import proc
from harness.probes.ckpt_format import OnDisk, inspect
from harness.probes.memory import MeasurementError, MemoryPeak, measure, read_captures
from harness.spec import Case, CaseOptions, Layout
from harness.suite_defs.ckpt_errors import describe_exception, refusal_kind
from harness.suite_defs.ckpt_memory.contract_judge import _judge, _judge_side_effects
from harness.suite_defs.ckpt_memory.payload import LoadTarget
from harness.suite_defs.ckpt_memory.figures import key, record_command
from harness.suite_defs.ckpt_memory.judge import _check_baseline, _check_contract, _check_model
from harness.suite_defs.ckpt_memory.params import CkptCaseParams
from harness.suite_defs.ckpt_memory.payload import SaveRankData

NAN, INF = float("nan"), float("inf")
DP4, TP2 = Layout.parse("tp1-pp1-cp1-dp4"), Layout.parse("tp2-pp1-cp1-dp2")


def _shards(values: dict[str, torch.Tensor]) -> list[ParamShard]:
    return [ParamShard(n, t, None, 0, 1) for n, t in values.items()]


def _reshard_result(fmt: str = "fully_reshardable") -> CaseResult:
    case = Case("ckpt-memory", load_model("tiny"), DP4, "mcore", CaseOptions(steps=2),
                params=CkptCaseParams(fmt, ckpt_role="reshard"))
    return CaseResult(case, [RankResult(0)], "ok")


def _target(layout: Layout = DP4, w=None, stepped=None, optim=None, **extra) -> LoadTarget:
    w = torch.ones(4) if w is None else w
    fields = {"loaded_optim": _shards({"w#exp_avg": torch.ones(4) if optim is None else optim}), **extra}
    return LoadTarget(layout.id, MemoryPeak("load", heap_peak=MIB), _shards({"w": w}),
                      stepped=_shards({"w": torch.full((4,), 2.0) if stepped is None else stepped}), **fields)


def _judge_one(target: LoadTarget, fmt: str = "fully_reshardable", saved_optim=True):
    saved, reference = {"w": torch.ones(4)}, {"w": torch.full((4,), 2.0)}
    optim = {"w#exp_avg": torch.ones(4)} if saved_optim else None
    return _judge(_reshard_result(fmt), fmt, DP4, [target], saved, reference, optim)


def _with_nan(n: int = 4) -> torch.Tensor:
    t = torch.ones(n)
    t[1] = NAN
    return t


# -- NaN / Inf -------------------------------------------------------------------------------------

def test_the_unmodified_values_pass():
    res = _judge_one(_target())
    assert res.passed and "loads with the saved values" in res.message


def test_nan_in_loaded_parameters_fails():
    res = _judge_one(_target(w=_with_nan()))
    assert not res.passed
    assert res.message.endswith("model parameters differ from the saved ones: w rel nan (must be 0) "
                                "(w: 1/4 elements non-finite (1 NaN, 0 Inf))")


def test_nan_in_the_step_after_the_load_fails():
    stepped = torch.full((4,), 2.0)
    stepped[0] = INF
    res = _judge_one(_target(stepped=stepped))
    assert not res.passed
    assert "the step after the load differs from the uninterrupted run" in res.message
    assert "w rel inf > 1e-05 (w: 1/4 elements non-finite (0 NaN, 1 Inf))" in res.message


@pytest.mark.parametrize("dtype,off,passes", [("fp32", 1e-3, False), ("bf16", 1e-3, True), ("bf16", 4e-2, False)])
def test_the_step_after_a_load_is_compared_at_the_dtypes_tolerance_across_layouts(dtype, off, passes):
    """bf16 steps at another layout differ by its rounding (up to 1.7e-3 measured); a load that leaves the learning
    rate at 0 is 3.6e-2 off."""
    res = _reshard_result()
    res = dataclasses.replace(res, case=dataclasses.replace(res.case, options=CaseOptions(steps=2, dtype=dtype)))
    saved, reference = {"w": torch.ones(4)}, {"w": torch.full((4,), 2.0)}
    judged = _judge(res, "fully_reshardable", DP4, [_target(stepped=torch.full((4,), 2.0 * (1 + off)))], saved,
                    reference, {"w#exp_avg": torch.ones(4)})
    assert judged.passed == passes, judged.message
    tol = "2e-02" if dtype == "bf16" else "1e-05"
    assert f"(<= {tol}, {dtype})" in "\n".join(judged.details)
    if not passes:
        assert f"the step after the load differs from the uninterrupted run (optimizer state not restored?): w rel " \
               f"{off:.2e} > {tol}" in judged.message


def test_a_save_side_effect_is_judged_at_fp32s_tolerance_in_every_dtype():
    """The step after a save runs at the layout that saved: the same reductions as the uninterrupted run."""
    res = _reshard_result()
    res = dataclasses.replace(res, case=dataclasses.replace(res.case, options=CaseOptions(steps=2, dtype="bf16")))
    judged = _judge_side_effects(res, "fully_reshardable", {"w": torch.full((4,), 1.001)}, {"w": torch.ones(4)})
    assert not judged.passed and "not <= 1e-05" in judged.message


def test_nan_in_loaded_optimizer_state_fails():
    res = _judge_one(_target(optim=_with_nan()))
    assert not res.passed
    assert res.message.endswith("optimizer state differs from the saved one: w#exp_avg rel nan (must be 0) "
                                "(w#exp_avg: 1/4 elements non-finite (1 NaN, 0 Inf))")


def test_nan_after_a_save_is_a_side_effect():
    res = _judge_side_effects(_reshard_result(), "fully_reshardable", {"w": _with_nan()}, {"w": torch.ones(4)})
    assert not res.passed
    assert res.message == ("fully_reshardable: the step after the save differs from the uninterrupted run: worst w "
                           "rel nan not <= 1e-05 (w: 1/4 elements non-finite (1 NaN, 0 Inf)) - the save changed "
                           "the training state")


def test_a_non_finite_measurement_is_a_regression():
    data = {"entries": {"k": {"m": {"value": 10.0, "tolerance": 2.0}}}}
    for bad in (NAN, INF, -INF):
        assert baselines.compare(data, "k", "m", bad).status == "regression"
    assert baselines.compare(data, "k", "m", 11.0).status == "pass"


def test_baseline_check_names_a_nan_figure():
    case = Case("ckpt-memory", load_model("small"), DP4, "mcore", CaseOptions(steps=1), params=CkptCaseParams())
    res = CaseResult(case, [RankResult(0, data=SaveRankData(MemoryPeak("save")))], "ok")
    data = {"entries": {key(case): {"rank0.save_heap_peak_mib": {"value": 29.0, "tolerance": 5.8}}}}
    check = _check_baseline(res, {"rank0.save_heap_peak_mib": NAN}, Source(Path("baselines.json"), data))
    assert not check.passed
    assert check.message.startswith("rank0.save_heap_peak_mib measured nan MiB (not a finite number) against "
                                    "baseline 29.00 +- 5.80 MiB")


def test_baseline_rows_state_the_smallest_detectable_regression():
    case = Case("ckpt-memory", load_model("small"), DP4, "mcore", CaseOptions(steps=1), params=CkptCaseParams())
    res = CaseResult(case, [RankResult(0, data=SaveRankData(MemoryPeak("save")))], "ok")
    entries = baselines.build_entries({key(case): {"rank0.save_heap_peak_mib": [29.0, 29.05, 29.0],
                                                         "rank0.save_writer_peak_mib": [0.16, 0.15, 0.16]}})
    check = _check_baseline(res, {"rank0.save_heap_peak_mib": 29.1, "rank0.save_writer_peak_mib": 0.15},
                            Source(Path("baselines.json"), {"entries": entries}))
    assert check.passed
    assert "rank0.save_heap_peak_mib: 29.10 MiB, baseline 29.00 +- 5.80, delta +0.10 MiB: pass; detects > +5.80 MiB " \
           "(+20%)" in check.details
    assert check.message.endswith("coarsest: rank0.save_writer_peak_mib detects > +0.25 MiB (+156%)")


def test_a_figure_judged_against_another_stacks_baseline_says_what_moved_and_how_to_bisect_it():
    """A stack whose own file lacks the case (e.g. the first run after an upgrade) is judged against the entry another
    stack recorded: the verdict stands, and its message names the components that differ, the bisect over the
    megatron-core releases between and the command that records this stack's own entry."""
    case = Case("ckpt-memory", load_model("small"), DP4, "mcore", CaseOptions(steps=1), params=CkptCaseParams())
    res = CaseResult(case, [RankResult(0, data=SaveRankData(MemoryPeak("save")))], "ok")
    peak, writer = "rank0.save_heap_peak_mib", "rank0.save_writer_peak_mib"
    data = {"entries": baselines.build_entries({key(case): {peak: [29.0, 29.0, 29.0], writer: [0.5, 0.5, 0.5]}})}
    across = ("Python 3.11.7 -> 3.12.1", "megatron-core 0.16.1 -> 0.19.2")
    path = Path("/b/cpu-gloo/py3.11-torch2.13.0-cpu-mcore0.16.1/ckpt-memory.json")
    moved = _check_baseline(res, {peak: 29.0, writer: 0.0}, Source(path, data, across))
    assert moved.failed and moved.improvement
    assert moved.message.startswith(f"{writer} 0.00 MiB is -0.50 MiB below (improvement: see below) baseline 0.50")
    assert ("; judged against another stack's baseline (py3.11-torch2.13.0-cpu-mcore0.16.1): moved with Python 3.11.7 "
            "-> 3.12.1, megatron-core 0.16.1 -> 0.19.2; find the release with `harness bisect --megatron-core "
            "0.16.1..0.19.2 --suite ckpt-memory --model small") in moved.message
    assert "--layout tp1-pp1-cp1-dp4" in moved.message and "--metric fail`" in moved.message
    assert moved.message.endswith(f"; record this stack's with `{record_command(case)}`")
    held = _check_baseline(res, {peak: 29.0, writer: 0.5}, Source(path, data, across))
    assert held.passed and held.message.endswith("; against the baseline of another stack (Python 3.11.7 -> 3.12.1, "
                                                 "megatron-core 0.16.1 -> 0.19.2)")
    downgrade = _check_baseline(res, {peak: 29.0, writer: 0.0},
                                Source(path, data, ("megatron-core 0.19.2 -> 0.16.1",)))
    assert "--megatron-core 0.16.1..0.19.2" in downgrade.message and "--find-fix" in downgrade.message


def test_a_baseline_entry_or_metric_that_was_never_recorded_is_named():
    """An absent entry fails a save's baseline (record it) and cannot tell for a load's (the committed GPU files
    predate them); a metric an entry lacks (recorded before it was measured) is named, not judged."""
    from harness.suite_defs.ckpt_memory.judge import check_baseline

    case = Case("ckpt-memory", load_model("small"), DP4, "mcore", CaseOptions(steps=1), params=CkptCaseParams())
    res = CaseResult(case, [RankResult(0, data=SaveRankData(MemoryPeak("save")))], "ok")
    path = Path("/b/cpu-gloo/ckpt-memory.json")
    peak, kept = "rank0.save_heap_peak_mib", "rank0.retained_per_save_mib"
    absent = check_baseline("x", res, {peak: 29.0}, Source(path, {"entries": {}}))
    assert absent.failed and absent.message.startswith(f"no baseline for {key(case)} {peak} on platform cpu-gloo")
    absent = check_baseline("x", res, {peak: 29.0}, Source(path, {"entries": {}}), missing_fails=False)
    assert absent.inconclusive and "record it with: harness baselines record --suite ckpt-memory" in absent.message
    data = {"entries": baselines.build_entries({key(case): {peak: [29.0, 29.0, 29.0]}})}
    older = check_baseline("x", res, {peak: 29.0, kept: 0.1}, Source(path, data))
    assert older.passed and older.message.endswith(f"not judged, recorded before they were measured: {kept} (re-record "
                                                   f"with `{record_command(case)}`)"), older.message
    only_new = check_baseline("x", res, {kept: 0.1}, Source(path, data))
    assert only_new.inconclusive and f"has none of {kept} (recorded before they were measured)" in only_new.message
    worse = check_baseline("x", res, {peak: 40.0, kept: 0.1}, Source(path, data))
    assert worse.failed and worse.message == f"{peak} 40.00 MiB is +11.00 MiB above baseline 29.00 +- 5.80 MiB"
    # a floor (a load's fixed cost, 3 MiB) widens a tolerance recorded narrower, never narrows one
    small = {"entries": baselines.build_entries({key(case): {peak: [2.2, 2.2, 2.2]}})}  # tolerance 0.44
    assert check_baseline("x", res, {peak: 1.6}, Source(path, small)).failed
    assert check_baseline("x", res, {peak: 1.6}, Source(path, small), floor=3.0).passed
    assert check_baseline("x", res, {peak: 34.0}, Source(path, data), floor=3.0).passed  # 5.80 recorded
    assert check_baseline("x", res, {peak: 35.0}, Source(path, data), floor=3.0).failed
    assert record_command(dataclasses.replace(case, layout=Layout(dp=2), params=CkptCaseParams(
        ckpt_role="reshard-load"))).startswith("harness baselines record --suite ckpt-memory --model small "
                                               "--world-size 4 ")


# -- refusals: the load's own, of the expected kind ----------------------------------------------

class _Wrapped(BaseException):
    """Stands for torch's CheckpointException: per-rank failures as (exception, traceback)."""

    def __init__(self, failures):
        super().__init__("CheckpointException ranks:dict_keys([0, 1])")
        self.failures = failures


MISSING = KeyError("optimizer.distributed.dp_group_idx_1.gbuf_idx_0.dtype_(torch.float32, torch.float32)"
                   ".bucket_idx_0.param from model not in state dict: ['decoder.final_layernorm.weight', ...]")


def test_refusal_kind_accepts_only_the_flat_buffer_mismatch():
    from megatron.core.dist_checkpointing.core import CheckpointingException

    shape = CheckpointingException("Global shape mismatch for loaded ((82240,)) and expected ((41280,)) tensor for "
                                   "key optimizer.distributed.dp_group_idx_0.gbuf_idx_0...param")
    assert refusal_kind(_Wrapped({0: (shape, None), 1: (MISSING, None)})).startswith(
        "the checkpoint's flat optimizer buffers do not fit this layout (CheckpointingException: Global shape mismatch")
    assert refusal_kind(_Wrapped({0: (MISSING, None), 1: (RuntimeError("gloo timeout"), None)})) == ""
    assert refusal_kind(RuntimeError("optimizer.distributed.x from model not in state dict")) == ""


def _refused(phase: str, exc: BaseException) -> LoadTarget:
    return LoadTarget(TP2.id, error=describe_exception(exc), phase=phase,
                      refusal=refusal_kind(exc) if phase == "load" else "", traceback="Traceback ...")


def test_a_refusal_by_the_load_passes_where_not_promised():
    res = _judge(_reshard_result("dp_reshardable"), "dp_reshardable", DP4,
                 [_refused("load", _Wrapped({0: (MISSING, None)}))], {}, {}, None)
    assert res.passed
    assert res.message == ("dp_reshardable saved at tp1-pp1-cp1-dp4, loaded at tp2-pp1-cp1-dp2 (not promised): "
                           "refused as the format allows: the checkpoint's flat optimizer buffers do not fit this "
                           "layout (KeyError: optimizer.distributed.dp_group_idx_1.gbuf_idx_0.dtype_(torch.float32, "
                           "torch.float32).bucket_idx_0.param from model not in state dict)")


def test_an_error_in_build_is_no_refusal():
    res = _judge(_reshard_result("dp_reshardable"), "dp_reshardable", DP4,
                 [_refused("build", RuntimeError("this engine cannot build at tp2-pp1-cp1-dp2"))], {}, {}, None)
    assert not res.passed
    assert res.message == ("dp_reshardable saved at tp1-pp1-cp1-dp4, loaded at tp2-pp1-cp1-dp2 (not promised): "
                           "failed on rank 0 in the build, before any load: RuntimeError: this engine cannot build "
                           "at tp2-pp1-cp1-dp2 (a refusal must come from the load)")


def test_another_load_error_is_no_refusal():
    res = _judge(_reshard_result("dp_reshardable"), "dp_reshardable", DP4,
                 [_refused("load", _Wrapped({0: (RuntimeError("Connection closed by peer"), None)}))], {}, {}, None)
    assert not res.passed
    assert "the load failed on rank 0 with an unexpected error: _Wrapped on 1 rank(s), first: RuntimeError: " \
           "Connection closed by peer" in res.message


def test_missing_optimizer_state_shards_fails_the_comparison():
    res = _judge_one(_target(loaded_optim=None))
    assert not res.passed
    assert res.message.endswith("Adam state not compared: the engine has no optimizer_state_shards() (exp_avg, "
                                "exp_avg_sq and step after the load cannot be checked)")


# -- measurements that cannot be taken raise -----------------------------------------------------

def test_missing_or_unreadable_capture_raises(tmp_path):
    with pytest.raises(MeasurementError, match=r"memray wrote no capture at .*nothing\.bin"):
        read_captures(tmp_path / "nothing.bin")
    bad = tmp_path / "garbage.bin"
    bad.write_bytes(b"not a memray capture")
    with pytest.raises(MeasurementError, match=r"memray capture .*garbage\.bin is unreadable"):
        read_captures(bad)


def test_unreadable_writer_capture_raises_and_absent_ones_are_fine(tmp_path):
    import memray

    capture = tmp_path / "memray-save-rank0.bin"
    with memray.Tracker(capture):
        keep = bytearray(1 << 20)
    del keep
    own, kids, n = read_captures(capture)  # no forked writer: none expected
    assert own >= 1 << 20 and (kids, n) == (0, 0)
    (tmp_path / "memray-save-rank0.bin.1234").write_bytes(b"truncated")
    with pytest.raises(MeasurementError, match=r"memray-save-rank0\.bin\.1234 is unreadable"):
        read_captures(capture)


def test_a_tracker_that_writes_nothing_makes_the_phase_raise(tmp_path, monkeypatch):
    import memray

    monkeypatch.setattr(memray, "Tracker", lambda *a, **k: contextlib.nullcontext())
    with pytest.raises(MeasurementError, match="memray wrote no capture"):
        with measure("save", tmp_path, 0):
            pass


def test_a_sampler_without_a_sample_makes_the_phase_raise(tmp_path, monkeypatch):
    import threading

    from harness.probes import memory

    def broken(pid, name):  # in the sampler's thread only: measure() itself reads VmRSS before it starts
        if threading.current_thread() is threading.main_thread():
            return proc.status_field(pid, name)
        raise MeasurementError(f"cannot read {name} from /proc/{pid}/status: [Errno 13] Permission denied")

    monkeypatch.setattr(memory, "status_field", broken)
    with pytest.raises(MeasurementError, match=r"the RSS sampler took no sample during save on rank 0 \(MeasurementError: "
                                               r"cannot read VmRSS from /proc/self/status: \[Errno 13\] Permission"):
        with measure("save", tmp_path, 0, use_memray=False):
            pass


def test_a_failure_inside_the_phase_keeps_its_own_exception(tmp_path, monkeypatch):
    import memray

    monkeypatch.setattr(memray, "Tracker", lambda *a, **k: contextlib.nullcontext())
    with pytest.raises(ValueError, match="the save itself"):
        with measure("save", tmp_path, 0):
            raise ValueError("the save itself")


def test_proc_status_without_the_field_raises(monkeypatch):
    with pytest.raises(MeasurementError, match="has no VmNothing line"):
        proc.status_field("self", "VmNothing")


# -- the format on disk ---------------------------------------------------------------------------

def _dcp(path, state: dict) -> str:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return str(path)


FLAT = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.float32, torch.float32).bucket_idx_0"


def test_on_disk_layout_is_read_from_the_optimizer_entries(tmp_path):
    w = torch.zeros(8, 4)
    flat = {"w": w, **{f"{FLAT}.{k}": torch.zeros(64) for k in ("param", "exp_avg", "exp_avg_sq")}}
    model_space = {"w": w, **{f"optimizer.state.{k}.w": torch.zeros(8, 4) for k in ("param", "exp_avg", "exp_avg_sq")}}
    wrong_shape = {"w": w, "optimizer.state.param.w": torch.zeros(32)}
    got = inspect(_dcp(tmp_path / "flat", flat))
    assert got.layout == "dp_reshardable" and "3 flat optimizer buffers of 1 DP group(s)" in got.evidence
    got = inspect(_dcp(tmp_path / "model", model_space))
    assert got.layout == "fully_reshardable" and "with the parameters' global shapes" in got.evidence
    got = inspect(_dcp(tmp_path / "wrong", wrong_shape))
    assert got.layout == "unknown" and "optimizer.state.param.w (32,) vs model (8, 4)" in got.evidence


def test_a_chained_optimizers_flat_buffers_are_read_through_their_prefix(tmp_path):
    """An MoE model at EP > 1: the dense and the expert optimizer's flat buffers, prefixed chained_<i>."""
    flat = {"w": torch.zeros(8, 4), **{f"chained_{i}.{FLAT}.{k}": torch.zeros(64)
                                       for i in (0, 1) for k in ("param", "exp_avg", "exp_avg_sq")}}
    got = inspect(_dcp(tmp_path / "chained", flat))
    assert got.layout == "dp_reshardable" and "6 flat optimizer buffers of 2 DP group(s)" in got.evidence


def test_fsdp2_full_state_dict_file_and_dcp_with_one_writer_are_full(tmp_path):
    full = {"model": {"w": torch.zeros(8, 4)}, "optim": {"state": {"w": {"exp_avg": torch.zeros(8, 4),
                                                                          "step": torch.tensor(1.0)}}}}
    (tmp_path / "f").mkdir()
    torch.save(full, tmp_path / "f" / "full_state_dict.pt")
    assert inspect(tmp_path / "f").layout == "fsdp2_full"
    dcp_one_writer = {"optim.state.w.exp_avg": torch.zeros(8, 4), "optim.state.w.step": torch.tensor(1.0)}
    got = inspect(_dcp(tmp_path / "d", dcp_one_writer))
    assert got.layout == "fsdp2_full" and got.evidence.startswith("DCP with one writer: 1 optimizer tensors")


def _memory_result(fmt: str, layout: Layout, peaks_mib: list[float], model: str = "small",
                   on_disk: OnDisk | None = None, label: dict | None = None, backend: str = "gloo",
                   pinned_mib: float = 0.0) -> CaseResult:
    engine = "fsdp2" if fmt.startswith("fsdp2") else "mcore"
    case = Case("ckpt-memory", load_model(model), layout, engine, CaseOptions(steps=1), backend, params=CkptCaseParams(fmt))
    peaks = [MemoryPeak("save", heap_peak=int(p * MIB), pinned_peak=int(pinned_mib * MIB)) for p in peaks_mib]
    ranks = [RankResult(r, data=SaveRankData(p)) for r, p in enumerate(peaks)]
    ranks[0].data = SaveRankData(peaks[0], on_disk=on_disk or OnDisk(fmt, "fabricated"),
                                 content_metadata=label if label is not None else {"distrib_optim_sharding_type": fmt})
    return CaseResult(case, ranks, "ok")


def test_contract_judges_the_files_not_the_label():
    disk = OnDisk("dp_reshardable", "3 flat optimizer buffers of 1 DP group(s)")
    res = _memory_result("fully_reshardable", DP4, [161.7, 155.4, 155.4, 155.4], on_disk=disk)
    check = _check_contract(res)
    assert not check.passed
    assert check.message == ("format fully_reshardable: the checkpoint on disk is dp_reshardable, not "
                             "fully_reshardable (3 flat optimizer buffers of 1 DP group(s))")
    assert "label written by the engine: fully_reshardable (agrees; secondary: the files decide)" in check.details


def test_mem_efficient_is_judged_by_the_measured_peaks():
    """Byte-identical on disk: a mem_efficient save whose ranks off DP rank 0 gathered is fully_reshardable."""
    disk = OnDisk("fully_reshardable", "24 per-parameter optimizer tensors")
    good = _memory_result("fully_reshardable_mem_efficient", DP4, [161.7, 17.3, 17.3, 17.3], on_disk=disk)
    check = _check_contract(good)
    assert check.passed and check.message.endswith("by the measured peaks fully_reshardable_mem_efficient")
    bad = _memory_result("fully_reshardable_mem_efficient", DP4, [161.7, 155.4, 155.4, 155.4], on_disk=disk)
    check = _check_contract(bad)
    assert not check.passed
    assert check.message == ("format fully_reshardable_mem_efficient: on disk fully_reshardable, by the measured "
                             "peaks fully_reshardable: ranks off DP rank 0 gathered the state: rank 1 peak 155.4 MiB "
                             ">= 12N = 69.0 MiB (3 of 3 ranks)")


def test_tiny_says_it_cannot_discriminate_formats():
    res = _memory_result("fully_reshardable", DP4, [3.7, 2.45, 2.45, 2.18], model="tiny")
    check = _check_model(res)
    assert check.inconclusive and not check.passed and not check.failed and check.status == "inconclusive"
    assert check.message.startswith("cannot tell: every rank's peak is inside the fully_reshardable band, which "
                                    "overlaps its rival's for this model and layout: cannot "
                                    "discriminate fully_reshardable from dp_reshardable at rank 0 for this model: "
                                    "12N = 0.94 MiB")
    contract = _check_contract(res)
    assert contract.passed and "mem_efficient: cannot tell: cannot discriminate" in contract.message


def test_small_rules_the_rival_out_and_flags_a_peak_outside_the_band():
    res = _memory_result("dp_reshardable", TP2, [18.2, 17.5, 6.0, 6.0])
    check = _check_model(res)
    assert check.passed and check.message == ("every rank inside the dp_reshardable band; it rules out the rival "
                                              "format on ranks [0, 1, 2, 3]")
    flipped = _memory_result("dp_reshardable", TP2, [86.6, 86.6, 86.4, 86.4])  # R1: every DP rank gathered
    check = _check_model(flipped)
    band = save_band("dp_reshardable", load_model("small"), TP2, 0)
    assert not check.passed and check.message == (f"rank 0 save host peak 86.6 MiB outside the dp_reshardable "
                                                  f"model band {band.describe()}")


DP1 = Layout.parse("tp1-pp1-cp1-dp1")


@pytest.mark.parametrize("fmt", ["fsdp2_sharded", "fsdp2_full", "fsdp2_default"])
def test_fsdp2_at_one_rank_cannot_tell_sharded_from_full(fmt):
    """One rank: a sharded and a full save are the same files (the first H100 run failed the contract here)."""
    disk = OnDisk("fsdp2_full", "DCP with one writer: 54 optimizer tensors in 54 chunks, written by ranks [0]")
    res = _memory_result(fmt, DP1, [0.4], on_disk=disk, label={"format": "fsdp2_sharded"})
    contract = _check_contract(res)
    assert contract.inconclusive, contract.message
    assert "with one DP rank fsdp2's sharded and full saves write the same files" in contract.message
    assert contract.message.endswith("needs world size 2 or more")
    model = _check_model(res)
    assert model.inconclusive and "the full and the sharded state dict are the same tensors" in model.message


def test_fsdp2_at_one_rank_still_fails_a_checkpoint_that_is_not_fsdp2():
    res = _memory_result("fsdp2_sharded", DP1, [0.4], on_disk=OnDisk("dp_reshardable", "flat buffers"))
    contract = _check_contract(res)
    assert contract.failed and "the checkpoint on disk is dp_reshardable, not fsdp2_sharded" in contract.message


def test_formats_at_dp1_cannot_be_told_apart_by_memory_but_a_peak_outside_every_band_fails():
    res = _memory_result("dp_reshardable", DP1, [46.9])
    check = _check_model(res)
    assert check.inconclusive and check.message.endswith("(both stage the whole 12N = 69.0 MiB): needs DP x CP >= 2")
    res = _memory_result("dp_reshardable", DP1, [400.0])
    assert _check_model(res).failed


def test_gpu_band_holds_the_pinned_staging_of_what_the_rank_writes():
    """On a GPU rank the save's device-to-host copies are staged in pinned blocks (rounded up to powers of two):
    the first H100 run measured fully_reshardable of `small` at D = 1 at 207 MiB of heap + ~96 MiB of new
    pinned blocks; with the staging counted the figure is inside the GPU band, outside the CPU one."""
    small = load_model("small")
    cpu, gpu = (save_band("fully_reshardable", small, DP1, 0, device=d) for d in (False, True))
    n = shard_params(small, DP1, 0)
    assert gpu.low == cpu.low and gpu.high - cpu.high == 2 * 16 * n  # up to 2 x (S + P) = 2 x 92 MiB staged
    res = _memory_result("fully_reshardable", DP1, [207.2], backend="nccl", pinned_mib=96.0)
    assert res.ranks[0].data.save.host_peak == int(207.2 * MIB) + 96 * MIB
    check = _check_model(res)
    assert not check.failed and "(pinned staging 96.0 MiB of it)" in check.details[0], check.details
    on_cpu = _memory_result("fully_reshardable", DP1, [303.2])
    assert _check_model(on_cpu).failed


def test_pinned_blocks_cut_during_the_phase_are_not_counted_twice():
    peak = MemoryPeak("save", heap_peak=100 * MIB, pinned_peak=96 * MIB, pinned_grown=96 * MIB)
    assert peak.host_peak == 100 * MIB  # the heap figure holds the blocks cut in the phase
    assert MemoryPeak("save", heap_peak=1 * MIB, pinned_peak=96 * MIB).host_peak == 97 * MIB


def test_a_device_measurement_records_device_peaks_and_the_pinned_pool_growth(monkeypatch, tmp_path):
    """The GPU path of probes.memory.measure on a CPU box, torch.cuda's counters stood in: the pinned pool's
    growth is its allocation after the phase minus before it (a name error here once failed every GPU save)."""
    import torch

    from harness.probes.memory import MIB, measure

    pool = {"allocated_bytes.current": 10 * MIB, "active_bytes.peak": 10 * MIB}
    fake = {"synchronize": lambda: None, "reset_peak_memory_stats": lambda: None, "memory_allocated": lambda: 5 * MIB,
            "max_memory_allocated": lambda: 70 * MIB, "max_memory_reserved": lambda: 80 * MIB,
            "host_memory_stats": lambda: dict(pool), "reset_peak_host_memory_stats": lambda: None}
    for name, fn in fake.items():
        monkeypatch.setattr(torch.cuda, name, fn, raising=False)
    with measure("save", tmp_path, 0, use_memray=False, device=True) as peak:
        pool.update({"allocated_bytes.current": 42 * MIB, "active_bytes.peak": 40 * MIB})
    assert (peak.device_allocated_before, peak.device_allocated_peak, peak.device_reserved_peak) == \
        (5 * MIB, 70 * MIB, 80 * MIB)
    assert (peak.pinned_peak, peak.pinned_grown) == (40 * MIB, 32 * MIB)


def test_the_pinned_staging_of_a_save_does_not_carry_what_earlier_cases_left_in_use(monkeypatch, tmp_path):
    """On the first GPU runs the pinned pool's active bytes grew save after save in a warm rank (torch 2.11:
    184, 368, 414 ... MiB, the pool not growing): a save's staging is what it held above the phase's start,
    the same whichever cases ran before it."""
    import torch

    from harness.probes.memory import MIB, measure

    pool: dict[str, int] = {}
    fake = {"synchronize": lambda: None, "reset_peak_memory_stats": lambda: None, "memory_allocated": lambda: 0,
            "max_memory_allocated": lambda: 0, "max_memory_reserved": lambda: 0,
            "host_memory_stats": lambda: dict(pool),
            "reset_peak_host_memory_stats": lambda: pool.update({"active_bytes.peak": pool["active_bytes.current"]})}
    for name, fn in fake.items():
        monkeypatch.setattr(torch.cuda, name, fn, raising=False)
    staged = []
    for left_in_use in (0, 184 * MIB, 1015 * MIB):  # a fresh rank, then after one and after several cases
        pool.update({"allocated_bytes.current": 256 * MIB, "active_bytes.current": left_in_use})
        with measure("save", tmp_path, 0, use_memray=False, device=True) as peak:
            pool.update({"active_bytes.current": left_in_use + 184 * MIB, "active_bytes.peak": left_in_use + 184 * MIB})
        staged.append(peak.pinned_peak)
    assert staged == [184 * MIB] * 3, [s / MIB for s in staged]


def test_an_moe_ranks_band_counts_its_experts_over_expert_dp():
    """small-moe at tp1-pp1-cp1-dp4-ep2: the experts' state sharded over the expert-DP group of 2, their weights
    written by its rank 0 (ranks 0 and 1); mem_efficient gathers the dense state on DP rank 0 and the experts' on
    each expert-DP rank 0, so rank 1 gathers the experts' alone (measured there: 68 MiB, inside the band)."""
    from harness.checks.memory_model import expert_shard_params

    m, lay = load_model("small-moe"), Layout.parse("tp1-pp1-cp1-dp4-ep2")
    ne = expert_shard_params(m, lay, 1)
    assert ne == 3 * 4 * (3 * 256 * 256)  # 3 MoE layers x 4 local experts x SwiGLU fc1 + fc2
    assert shard_params(m, lay, 1) - ne == shard_params(m, lay, 0) - ne  # the dense part is every rank's
    band = save_band("fully_reshardable_mem_efficient", m, lay, 1)
    assert band.low == 12 * ne and "gathered on expert-DP rank 0" in band.why
    assert save_band("fully_reshardable_mem_efficient", m, lay, 2).low == 0
    assert save_band("fully_reshardable_mem_efficient", m, lay, 0).low == 12 * shard_params(m, lay, 0)
    dp = save_band("dp_reshardable", m, lay, 1)  # S/D + S_e/E + P_e: rank 1 writes its experts' weights
    nd = shard_params(m, lay, 1) - ne
    assert dp.high == 12 * nd // 4 + 12 * ne // 2 + 4 * ne + FIXED_COST


def test_retained_memory_is_recorded_with_its_own_floor():
    """A rank process fills a cache once over a few saves: retained_per_save_mib moved 0.05 -> 0.39 MiB between
    repeats on gloo ranks, inside its 0.5 MiB floor; a heap peak spreading as much is refused (0.25 MiB)."""
    from harness.suite_defs.ckpt_memory.suite import CkptMemorySuite

    suite = CkptMemorySuite()
    moved = [0.379, 0.045, 0.046]
    assert suite.noisy_metrics({"k": {"rank0.retained_per_save_mib": moved}}) == []
    (noisy,) = suite.noisy_metrics({"k": {"rank0.save_heap_peak_mib": moved}})
    assert noisy.startswith("k rank0.save_heap_peak_mib: spread 0.334 over 3 repeats > tolerance 0.250")
    assert suite.tolerance("rank0.retained_per_save_mib", [0.04, 0.045, 0.05]) == 0.5
    assert suite.tolerance("rank0.save_heap_peak_mib", [0.9, 0.92, 0.95]) == 0.25


def test_a_baseline_checks_figures_reach_results_json_as_the_report_reads_them(tmp_path):
    """CheckResult.data is typed (BaselineFigures); results.json holds its fields, which the checkpoint plot reads."""
    import json

    from harness.checks import CheckResult
    from harness.report import plots
    from harness.report.results_file import to_json
    from harness.report.runs import RunFile
    from harness.suite_defs.ckpt_memory.suite import CkptMemorySuite
    from harness.baselines import BaselineFigures
    from harness.suite_run import SuiteRun

    case = Case("ckpt-memory", load_model("small"), DP4, "mcore", CaseOptions(steps=1), params=CkptCaseParams())
    res = CaseResult(case, [RankResult(0, data=SaveRankData(MemoryPeak("save")))], "ok")
    entries = baselines.build_entries({key(case): {"rank0.save_heap_peak_mib": [29.0, 29.05, 29.0]}})
    check = _check_baseline(res, {"rank0.save_heap_peak_mib": 40.0}, Source(Path("baselines.json"), {"entries": entries}))
    assert isinstance(check.data, BaselineFigures) and check.data.metrics["rank0.save_heap_peak_mib"].status == \
        "regression"
    run = SuiteRun(CkptMemorySuite(), "small", 4, "gloo", "mcore", results=[res])
    run.checks = [check, CheckResult("ckpt-memory.contract", case.id, True, "ok")]
    path = tmp_path / "results.json"
    path.write_text(json.dumps(to_json(run)))
    read = plots._baseline_checks(RunFile(path, json.loads(path.read_text())))
    assert read[case.id]["rank0.save_heap_peak_mib"] == {"status": "regression", "measured": 40.0,
                                                          "baseline": 29.0, "tolerance": pytest.approx(5.8)}
    assert json.loads(path.read_text())["checks"][1]["data"] == {}


# -- the load's device peak on GPU ranks ------------------------------------------------------------

def _device_load(model: str, layout: Layout, extra: int, dtype: str = "fp32", fmt: str = "dp_reshardable"):
    """A load on NCCL ranks whose device peak above its start is what megatron-core 0.16.1 allocates (the fresh
    Adam state, 2/3 of the rank's part S/D, and a GLU model's fc1 merge), plus `extra` bytes."""
    from harness.checks.memory_model import glu_params
    from harness.suite_defs.ckpt_memory.contract_judge import judge_load_peak

    spec = load_model(model)
    case = Case("ckpt-memory", spec, layout, "mcore", CaseOptions(steps=2, dtype=dtype), backend="nccl",
                params=CkptCaseParams(fmt, ckpt_role="reshard"))
    own = [12 * shard_params(spec, layout, r) // layout.dp for r in range(layout.world_size)]
    used = [2 * own[r] // 3 + 4 * glu_params(spec, layout, r) + extra for r in range(layout.world_size)]
    before = 3 * own[0]
    targets = [LoadTarget(layout.id, MemoryPeak("load", heap_peak=MIB, device_allocated_before=before,
                                                device_allocated_peak=before + u)) for u in used]
    res = CaseResult(case, [RankResult(r) for r in range(layout.world_size)], "ok")
    return judge_load_peak(res, fmt, targets), own


def test_a_loads_device_peak_is_judged_on_gpu_ranks_and_a_second_copy_of_the_state_fails():
    """Megatron-Bridge PR #4936's shape on the device: the optimizer's state materialised twice at load."""
    dp2 = Layout.parse("tp1-pp1-cp1-dp2")
    ok, _ = _device_load("small", dp2, 2 * MIB)
    assert ok.passed and ok.message.endswith("every rank's load device peak above its start inside its load band")
    assert "(host peak 1.0 MiB)" in ok.details[0]
    own = 12 * shard_params(load_model("small"), dp2, 0) // 2
    bad, _ = _device_load("small", dp2, own)
    assert bad.failed
    assert bad.message.startswith("dp_reshardable loaded at tp1-pp1-cp1-dp2: rank 0 load device peak above its "
                                  "start ") and "outside the load band [0.0, " in bad.message
    assert bad.message.endswith("(2 of 2 ranks)")
    full, _ = _device_load("small", dp2, own, fmt="fully_reshardable")
    assert full.failed and "fully_reshardable load on the device" in full.message


def test_a_loads_device_peak_that_cannot_tell_says_so():
    tiny, _ = _device_load("tiny", Layout.parse("tp1-pp1-cp1-dp2"), 0)
    assert tiny.inconclusive and "would stay in the device band" in tiny.message
    bf16, _ = _device_load("small", Layout.parse("tp1-pp1-cp1-dp2"), 0, dtype="bf16")
    assert bf16.inconclusive and "the device load model is of fp32 state, this case trains in bf16" in bf16.message
    assert bf16.details[0].startswith("  rank 0: load device peak above its start ")


def test_the_device_band_names_the_ranks_own_part_of_the_state():
    from harness.checks.memory_model import device_load_band

    small, dp2 = load_model("small"), Layout.parse("tp1-pp1-cp1-dp2")
    own = 12 * shard_params(small, dp2, 0) // 2
    for fmt in ("dp_reshardable", "fully_reshardable"):
        assert f"(2/3 x S/D, S/D={own / MIB:.1f} MiB)" in device_load_band(fmt, small, dp2, 0).why
