"""Bridge construction paths (mbridge, megatron-bridge): they build the same model as mcore, their
gradient sync is what the user configured, R2 on the vanilla bridge is caught, and a missing bridge
package is reported with its install command."""

from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys
import textwrap

import pytest

from harness.driver import execute, plan, run_suite
from harness.engines import mbridge, megatron_bridge_import, resolve_factory
from harness.engines.wrap_config import WrapConfig, ddp_config_dict
from harness.errors import MissingDependency, NotOnThisStack
from harness.spec import CaseOptions

BRIDGES = ("mbridge", "megatron-bridge")
INSTALL = {"mbridge": mbridge.INSTALL, "megatron-bridge": megatron_bridge_import.INSTALL}


def _missing(engine: str) -> str | None:
    """The engine's own MissingDependency line (names the install command) or its NotOnThisStack line (a path the
    installed releases cannot run together: mbridge 0.15.1 on megatron-core >= 0.18), or None where it runs."""
    try:
        resolve_factory(engine)
    except (MissingDependency, NotOnThisStack) as exc:
        return str(exc)
    return None


def _installed(engine: str):
    reason = _missing(engine)
    return pytest.param(engine, id=engine, marks=pytest.mark.skipif(reason is not None, reason=reason or ""))


def _run_some(suite: str, model: str, layouts: list[str], engine: str, keep, options: CaseOptions | None = None):
    """The suite's cases at world size 2 whose options `keep` accepts, run and judged."""
    planned = plan(suite, model, 2, layouts, backend="gloo", engine=engine, options=options)
    return execute(dataclasses.replace(planned, cases=[c for c in planned.cases if keep(c.options)]))


def _failures(run) -> list[str]:
    return [c.message for c in run.checks if c.failed] + [r.error for r in run.results if r.error]


# -- wrap config ----------------------------------------------------------------------------------
def test_wrap_config_is_what_the_user_configured_with_overrides_on_top():
    wrap = WrapConfig.from_options(CaseOptions(use_distributed_optimizer=False, overlap_grad_reduce=True))
    merged = ddp_config_dict(wrap, {"overlap_grad_reduce": False, "bucket_size": 1000})
    assert merged == {"use_distributed_optimizer": False, "overlap_grad_reduce": False, "grad_reduce_in_fp32": False,
                      "overlap_param_gather": False, "average_in_collective": False, "bucket_size": 1000}
    assert ddp_config_dict(wrap) == ddp_config_dict(wrap, None) == ddp_config_dict(wrap, {}) != {}
    assert "bucket_size" not in ddp_config_dict(wrap)  # megatron's default where the case sets none
    assert ddp_config_dict(WrapConfig.from_options(CaseOptions(bucket_size=1_000_000)))["bucket_size"] == 1_000_000


def test_wrap_config_dict_is_valid_ddp_config():
    from megatron.core.distributed import DistributedDataParallelConfig

    cfg = DistributedDataParallelConfig(**ddp_config_dict(WrapConfig.from_options(CaseOptions(use_distributed_optimizer=True))))
    assert cfg.use_distributed_optimizer and not cfg.overlap_grad_reduce and not cfg.grad_reduce_in_fp32


# -- missing packages -----------------------------------------------------------------------------
@pytest.mark.parametrize("engine, module", [("mbridge", "mbridge"), ("mbridge", "transformers"),
                                            ("megatron-bridge", "megatron.bridge"), ("megatron-bridge", "omegaconf"),
                                            ("tests.plants.faulty_engines:MbridgeOverrideOnly", "mbridge")])
def test_missing_package_exits_2_with_the_install_command(monkeypatch, capsys, engine, module):
    from harness.cli import main

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else find_spec(name, *a))
    bridge = engine if engine in INSTALL else "mbridge"
    with pytest.raises(MissingDependency) as exc:
        resolve_factory(engine)
    assert f"(no module {module!r})" in str(exc.value) and str(exc.value).endswith(INSTALL[bridge])
    assert main(["run", "--suite", "equivalence", "--model", "tiny", "--world-size", "2", "--engine", engine]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("harness: error: engine ") and err[0].endswith(INSTALL[bridge])


# -- the scoped import stub of the megatron-bridge path -------------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(_missing("megatron-bridge") is not None, reason=_missing("megatron-bridge") or "")
def test_megatron_bridge_import_stub_is_scoped():
    """Only the failing imports get a stub; afterwards nothing (sys.modules, find_spec, megatron.core's
    feature flags) sees transformer_engine / triton."""
    code = textwrap.dedent("""
        import importlib.util, sys
        from harness.engines import megatron_bridge_import as mb
        gpu_missing = {p for p in mb.GPU_ONLY if importlib.util.find_spec(p) is None}
        mb.import_bridge()
        import megatron.bridge, megatron.core.transformer.attention as attention
        assert all(pkg in mb.GPU_ONLY for _, pkg in mb.stubbed_imports), mb.stubbed_imports
        assert not [m for m in sys.modules if m.partition(".")[0] in gpu_missing]
        assert all(importlib.util.find_spec(p) is None for p in gpu_missing)
        if "transformer_engine" in gpu_missing:
            assert ("megatron.bridge.peft.lora_layers", "transformer_engine") in mb.stubbed_imports
            assert attention.HAVE_TE is False
        print("ok", mb.stubbed_imports)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    last = (out.stdout.strip().splitlines() or [""])[-1]  # (megatron-bridge 0.6 logs its probes on stdout)
    assert out.returncode == 0 and last.startswith("ok"), out.stderr[-3000:]


# -- the bridges build mcore's model ------------------------------------------------------------
@pytest.fixture(scope="module")
def mcore_tp2():
    run = run_suite("equivalence", "tiny", 2, ["tp2-pp1-cp1-dp1"], backend="gloo", engine="mcore")
    assert run.passed, _failures(run)
    return run


@pytest.mark.slow
@pytest.mark.parametrize("engine", [_installed(e) for e in BRIDGES])
def test_bridge_equivalence_passes_and_matches_mcore(engine, mcore_tp2):
    run = run_suite("equivalence", "tiny", 2, ["tp2-pp1-cp1-dp1"], backend="gloo", engine=engine)
    assert run.passed, _failures(run)
    # same initial weights, data and numerics as the mcore engine: bit-identical losses per step
    assert [run.suite.metrics(r) for r in run.results] == [mcore_tp2.suite.metrics(r) for r in mcore_tp2.results]


@pytest.mark.slow
@pytest.mark.parametrize("engine", [_installed(e) for e in BRIDGES])
def test_bridge_grad_sync_is_what_the_user_configured(engine):
    """All four (use_distributed_optimizer, overlap_grad_reduce) cases at DP=2: the observed collectives
    match the plan derived from the options, and the replicas stay identical."""
    run = run_suite("grad-sync", "tiny", 2, ["tp1-pp1-cp1-dp2"], backend="gloo", engine=engine)
    assert len(run.results) == 4
    assert run.passed, _failures(run)


@pytest.mark.slow
@pytest.mark.skipif(_missing("mbridge") is not None, reason=_missing("mbridge") or "")
def test_r2_override_only_ddp_config_is_caught():
    run = run_suite("grad-sync", "tiny", 2, ["tp1-pp1-cp1-dp2"], backend="gloo",
                    engine="tests.plants.faulty_engines:MbridgeOverrideOnly")
    off = [r.case.id for r in run.results if not r.case.options.use_distributed_optimizer]
    assert off and not run.passed
    plan = {c.case_id: c.message for c in run.checks if c.check == "grad-sync.plan" and c.failed}
    drift = {c.case_id for c in run.checks if c.check == "grad-sync.replicas" and c.failed}
    for cid in off:
        assert plan[cid].startswith("grad-sync: rank 0: configured all-reduce (use_distributed_optimizer=False")
        assert "but observed reduce_scatter_tensor_coalesced_ on dp-cp group (0, 1)" in plan[cid]
        assert cid in drift


@pytest.mark.slow
@pytest.mark.parametrize("engine", [pytest.param("mcore", marks=pytest.mark.nightly),  # the bridges are the point
                                    *(_installed(e) for e in BRIDGES)])
def test_every_path_builds_the_qwen3_moe_it_was_asked_for(engine):
    """tiny-qwen3-moe at EP 2 with TP 2: its q/k layernorms in the gradient buffer, MoE layers (mbridge's CPU spec
    built dense MLPs, and its dispatcher issued no token all-to-all), sequence parallelism with TP; the grad-sync
    plan and the dispatcher's collectives as planned. One option set (the distributed optimizer, overlapped): what is
    built does not depend on it, and every option set's translation is test_bridge_grad_sync_is_what_the_user_configured's."""
    run = _run_some("grad-sync", "tiny-qwen3-moe", ["tp2-pp1-cp1-dp1-ep2-etp1"], engine,
                    lambda o: o.use_distributed_optimizer and o.overlap_grad_reduce)
    assert len(run.results) == 1
    assert run.passed, _failures(run)
    assert {c.check for c in run.checks if c.passed} >= {"grad-sync.plan", "grad-sync.dispatch"}


@pytest.mark.slow
@pytest.mark.parametrize("engine", [_installed(e) for e in BRIDGES])
def test_the_bridges_train_with_the_cases_training_options(engine):
    """golden's trajectory from a loss mask (per-token normalisation) and a warmup-cosine learning-rate schedule,
    recorded on the mcore path: each bridge reproduces it. They once built without the one and stepped without the
    other (step 1's grad norm 3% off, its learning rate 1e-3 where the warmup starts at 0). The trajectory alone: the
    resumes through each bridge, and fsdp2's beside them, are the nightly's (below)."""
    run = run_suite("golden", "tiny", 2, ["tp1-pp1-cp1-dp2"], backend="gloo", engine=engine,
                    suite_params={"formats": ()})
    assert [(r.case.engine, r.case.params.role) for r in run.results] == [(engine, "")]
    assert run.passed, _failures(run)


@pytest.mark.slow
@pytest.mark.nightly
@pytest.mark.parametrize("engine", [_installed(e) for e in BRIDGES])
def test_the_bridges_resume_golden_from_each_format(engine):
    """golden's whole plan through each bridge: its resumes of every format (at another layout where the format
    reshards) on the trajectory recorded on the mcore path, and fsdp2's run beside them."""
    run = run_suite("golden", "tiny", 2, ["tp1-pp1-cp1-dp2"], backend="gloo", engine=engine)
    assert any(r.case.params.role == "resume" and r.case.engine == engine for r in run.results)
    assert run.passed, _failures(run)


@pytest.mark.slow
@pytest.mark.parametrize("engine", [_installed(e) for e in BRIDGES])
def test_the_bridges_reduce_gradients_in_the_cases_buckets(engine):
    """A case's DDP bucket size reaches each bridge's DDP config: grad-sync plans 1M-element buckets (step-perf's
    overlap cases set them). The bridges once built with megatron's 40M default, one bucket where mcore had five."""
    run = _run_some("grad-sync", "small", ["tp1-pp1-cp1-dp2"], engine, lambda o: o.overlap_grad_reduce,
                    CaseOptions(steps=1, bucket_size=1_000_000))  # the two overlapped cases: buckets are theirs
    planned = [c for c in run.checks if c.check == "grad-sync.plan"]
    assert len(planned) == 2
    assert planned and all(c.passed for c in planned), _failures(run)


@pytest.mark.slow
@pytest.mark.skipif(_missing("mbridge") is not None, reason=_missing("mbridge") or "")
def test_a_bridge_without_the_training_options_fails_golden():
    run = run_suite("golden", "tiny", 2, ["tp1-pp1-cp1-dp2"], backend="gloo",
                    engine="tests.plants.faulty_engines:MbridgeWithoutTrainingOptions")
    trajectory = [c.message for c in run.checks if c.check == "golden.trajectory" and c.failed]
    assert trajectory and all("step 1: grad_norm" in m and "lr 0.001 vs golden 0" in m for m in trajectory), trajectory
