"""CaseSelection: the shared case-selection flags parsed, validated, and turned back into the same flags
(what a bisect step or a compare round in another process runs)."""

from __future__ import annotations

import pytest

from harness import cli
from harness.selection import CaseSelection
from harness.errors import BadInput
from harness.spec import CaseOptions


def _parse(*argv: str, command: str = "run") -> CaseSelection:
    extra = ["--metric", "fail"] if command in ("bisect", "bisect-step") else []
    return CaseSelection.from_args(cli.build_parser().parse_args([command, *argv, *extra]))


def test_defaults():
    sel = _parse("--suite", "equivalence")
    assert sel == CaseSelection("equivalence")
    assert sel.to_argv() == ["--suite", "equivalence"]
    assert (sel.suite, sel.model, sel.world_size, sel.layout_ids) == ("equivalence", None, 4, None)
    assert (sel.engine, sel.backend, sel.options, sel.timeout, sel.suite_params) == ("mcore", "auto", CaseOptions(),
                                                                                     None, {})


# every flag, one at a time: (argv after --suite ..., the field it sets)
EACH_FLAG = [
    (["--model", "small"], dict(model="small")),
    (["--world-size", "2"], dict(world_size=2)),
    (["--layout", "tp1-pp1-cp1-dp2", "--layout", "tp2-pp1-cp1-dp1"], dict(layouts=("tp1-pp1-cp1-dp2", "tp2-pp1-cp1-dp1"))),
    (["--engine", "pkg.mod:make"], dict(engine="pkg.mod:make")),
    (["--backend", "gloo"], dict(backend="gloo")),
    (["--steps", "5"], dict(options=CaseOptions(steps=5))),
    (["--seed", "7"], dict(options=CaseOptions(seed=7))),
    (["--dtype", "bf16"], dict(options=CaseOptions(dtype="bf16"))),
    (["--distributed-optimizer"], dict(options=CaseOptions(use_distributed_optimizer=True))),
    (["--overlap-grad-reduce"], dict(options=CaseOptions(overlap_grad_reduce=True))),
    (["--timeout", "12.5"], dict(timeout=12.5)),
    (["--ckpt-format", "dp_reshardable", "--ckpt-format", "fully_reshardable"],
     dict(suite_params={"formats": ("dp_reshardable", "fully_reshardable")})),
    (["--fully-parallel-save"], dict(suite_params={"fully_parallel_save": True})),
    (["--async-save"], dict(suite_params={"async_save": True})),
    (["--timed-steps", "6"], dict(suite_params={"timed_steps": 6})),
    (["--min-effect", "0.1"], dict(suite_params={"min_effect": 0.1})),
]


@pytest.mark.parametrize("argv,fields", EACH_FLAG, ids=[a[0] for a, _ in EACH_FLAG])
@pytest.mark.parametrize("command", ["run", "baselines", "bisect", "bisect-step"])
def test_each_flag_round_trips(argv, fields, command):
    pre = ["check"] if command == "baselines" else []
    sel = _parse(*pre, "--suite", "ckpt-memory", *argv, command=command)
    assert sel == CaseSelection("ckpt-memory", **fields)
    assert sel.to_argv() == ["--suite", "ckpt-memory", *argv]
    assert _parse(*pre, *sel.to_argv(), command=command) == sel


def test_every_flag_at_once_round_trips_and_plans():
    argv = [x for a, _ in EACH_FLAG for x in a]
    sel = _parse("--suite", "ckpt-memory", *argv)
    assert set(sel.to_argv()) == {"--suite", "ckpt-memory", *argv}
    assert _parse(*sel.to_argv()) == sel
    assert (sel.engine, sel.backend, sel.timeout) == ("pkg.mod:make", "gloo", 12.5)
    assert sel.options == CaseOptions(steps=5, seed=7, dtype="bf16", use_distributed_optimizer=True,
                                      overlap_grad_reduce=True)
    assert sel.suite_params == {"formats": ("dp_reshardable", "fully_reshardable"), "fully_parallel_save": True,
                                "async_save": True, "timed_steps": 6, "min_effect": 0.1}
    assert (sel.suite, sel.model, sel.world_size) == ("ckpt-memory", "small", 2)
    assert sel.layout_ids == ["tp1-pp1-cp1-dp2", "tp2-pp1-cp1-dp1"]


def test_skip_leaves_flags_out():
    sel = _parse("--suite", "step-perf", "--engine", "x.y:z", "--timed-steps", "5", "--layout", "tp1-pp1-cp1-dp4")
    assert sel.to_argv(skip=("engine", "timed_steps")) == ["--suite", "step-perf", "--layout", "tp1-pp1-cp1-dp4"]
    assert sel.to_argv(skip=("layout",)) == ["--suite", "step-perf", "--engine", "x.y:z", "--timed-steps", "5"]


def test_compare_selects_its_first_engine():
    args = cli.build_parser().parse_args(["compare", "--engine", "a.b:c", "--engine", "d.e:f", "--min-effect", "0.2"])
    sel = CaseSelection.from_args(args)
    assert sel.suite == "step-perf" and sel.engine == "a.b:c" and sel.suite_params == {"min_effect": 0.2}
    assert CaseSelection.from_args(cli.build_parser().parse_args(["compare"])).engine == "mcore"


def test_a_selection_without_flags_for_it_is_refused():
    with pytest.raises(ValueError, match="options without a flag: \\['lr'\\]"):
        CaseSelection("equivalence", options=CaseOptions(lr=0.5)).to_argv()
    with pytest.raises(ValueError, match="suite parameters without a flag"):
        CaseSelection("equivalence", suite_params={"mix": "long"}).to_argv()


@pytest.mark.parametrize("argv,message", [
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--seed", "-3"], "--seed must be >= 0, got -3"),
    (["--timeout", "-1"], "--timeout must be > 0 seconds, got -1.0"),
    (["--timeout", "nan"], "--timeout must be > 0 seconds, got nan"),
    (["--timed-steps", "2"], "--timed-steps must be >= 3 (the statistics need samples), got 2"),
    (["--min-effect", "0"], "--min-effect is a fraction of the baseline median (e.g. 0.1 for 10%), got 0.0"),
    (["--min-effect", "10"], "--min-effect is a fraction of the baseline median"),
])
def test_out_of_range_values_are_bad_input(argv, message):
    with pytest.raises(BadInput) as exc:
        _parse("--suite", "step-perf", *argv)
    assert message in str(exc.value)


@pytest.mark.parametrize("gpus,argv,dtype,round_trip", [
    (0, [], "fp32", []),  # gloo ranks: fp32
    (1, ["--world-size", "1"], "bf16", ["--world-size", "1"]),  # NCCL ranks: step-perf in bf16 ...
    (1, ["--world-size", "1", "--dtype", "fp32"], "fp32", ["--world-size", "1", "--dtype", "fp32"]),  # ... unless asked
    (1, ["--world-size", "1", "--backend", "gloo"], "fp32", ["--world-size", "1", "--backend", "gloo"]),
])
def test_step_perf_trains_in_bf16_on_gpu_ranks_unless_told(monkeypatch, gpus, argv, dtype, round_trip):
    monkeypatch.setattr("harness.platform.backend.cuda_device_count", lambda: gpus)
    sel = _parse("--suite", "step-perf", *argv)
    assert sel.options.dtype == dtype
    assert sel.to_argv() == ["--suite", "step-perf", *round_trip]
    assert _parse(*sel.to_argv()) == sel
    assert _parse("--suite", "golden", *argv).options.dtype == "fp32"  # numerics stay at fp32 tolerances


def test_a_run_without_options_trains_in_the_suites_dtype_for_the_backend(monkeypatch):
    """run_suite / plan without options (the pytest suites, record --missing): step-perf's cases on NCCL
    ranks in bf16, their baseline key and record command naming it only where it is not the default."""
    import dataclasses

    from harness import driver, planning
    from harness.suite_defs.step_perf import figures

    monkeypatch.setattr(planning, "resolve_backend", lambda backend, world_size: backend)
    monkeypatch.setattr(planning, "refuse_what_does_not_fit", lambda cases, backend, world_size: None)
    monkeypatch.setattr("harness.platform.detect_platform",
                        lambda backend: type("P", (), {"key": "nccl-test" if backend == "nccl" else "cpu-gloo"}))
    cases = driver.plan("step-perf", "tiny", 1, backend="nccl").cases
    assert {c.options.dtype for c in cases} == {"bf16"}
    assert figures.key(cases[0]) == "tiny/tp1-pp1-cp1-dp1/distopt=0,overlap=0/bf16"
    assert "--dtype" not in figures.record_command(cases[0])
    fp32 = dataclasses.replace(cases[0], options=dataclasses.replace(cases[0].options, dtype="fp32"))
    assert figures.key(fp32) == "tiny/tp1-pp1-cp1-dp1/distopt=0,overlap=0"
    assert figures.record_command(fp32).endswith("--layout tp1-pp1-cp1-dp1 --backend nccl --dtype fp32")
    golden = driver.plan("golden", "tiny", 1, backend="nccl").cases
    assert {c.options.dtype for c in golden} == {"fp32"}
    cpu = driver.plan("step-perf", "tiny", 1, backend="gloo").cases
    assert {c.options.dtype for c in cpu} == {"fp32"}


def test_plan_starts_nothing_and_run_plans_once(monkeypatch):
    """plan() is pure (no rank, no fork server: pytest collects step-perf's cases with it); `harness run` plans
    once and executes that plan."""
    from harness import driver
    from harness.launch import zygote

    def no_start(backend, preload=()):
        raise AssertionError("plan() started the fork server")

    monkeypatch.setattr(zygote, "prestart", no_start)
    planned = driver.plan("equivalence", "tiny", 2, backend="gloo")
    assert planned.model_name == "tiny" and planned.backend == "gloo" and len(planned.cases) >= 2
    monkeypatch.setattr(zygote, "prestart", lambda backend, preload=(): None)
    calls, executed = [], []
    real = driver.plan
    monkeypatch.setattr(driver, "plan", lambda *a, **k: calls.append(a) or real(*a, **k))

    def execute(p, **run_options):
        executed.append(p)
        raise SystemExit(0)

    monkeypatch.setattr(driver, "execute", execute)
    args = cli.build_parser().parse_args(["run", "--suite", "equivalence", "--world-size", "2", "--backend", "gloo"])
    with pytest.raises(SystemExit):
        args.func(args)
    assert len(calls) == 1 and executed[0].cases == planned.cases


def test_nccl_over_several_nodes_needs_a_gpu_per_rank_of_the_node_not_of_the_world(monkeypatch):
    """torchrun --nnodes 2 --nproc-per-node 4: 8 ranks, 4 GPUs on each node; plan checks the node's ranks."""
    from harness import driver, planning

    monkeypatch.setattr("harness.platform.backend.cuda_device_count", lambda: 4)
    monkeypatch.setattr(planning, "refuse_what_does_not_fit", lambda cases, backend, world_size: None)
    cases = driver.plan("equivalence", "tiny", 8, backend="nccl", local_world_size=4).cases
    assert cases and {c.backend for c in cases} == {"nccl"}
    with pytest.raises(BadInput, match="world size 8 but 4 GPU"):  # the whole world on one node's GPUs
        driver.plan("equivalence", "tiny", 8, backend="nccl")


def test_gloo_over_several_nodes_shares_a_host_among_the_ranks_of_its_node(monkeypatch):
    """torchrun --nnodes 4 --nproc-per-node 2 on gloo: each host's memory goes to its 2 ranks, not to 8."""
    from harness import driver
    from harness.errors import DoesNotFit

    shares = []
    monkeypatch.setattr("harness.platform.backend.memory_per_rank",
                        lambda backend, ranks: shares.append(ranks) or 1 << 40)
    driver.plan("train-memory", "tiny", 8, backend="gloo", local_world_size=2)
    driver.plan("train-memory", "tiny", 8, backend="gloo")  # one host runs all 8
    assert shares == [2, 8]
    monkeypatch.setattr("harness.platform.backend.memory_per_rank", lambda backend, ranks: (1 << 20) // ranks)
    with pytest.raises(DoesNotFit, match="will not fit"):
        driver.plan("train-memory", "tiny", 8, backend="gloo", local_world_size=2)


def test_the_torchrun_entry_plans_with_the_ranks_of_its_node(monkeypatch):
    from harness import driver, torchrun

    asked = {}

    def plan(*args, **kwargs):
        asked.update(kwargs, world_size=args[2])
        raise BadInput("stop here")

    monkeypatch.setattr(driver, "plan", plan)
    monkeypatch.setattr(torchrun, "gpus_from_device_files", lambda: 8)  # a node of 8 GPUs
    monkeypatch.setenv("HARNESS_PHASE_LOG", "0")
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")  # torchrun.main sets it for NCCL ranks: undone after
    for name, value in (("RANK", "3"), ("WORLD_SIZE", "16"), ("LOCAL_WORLD_SIZE", "8")):
        monkeypatch.setenv(name, value)
    assert torchrun.main(["--suite", "equivalence", "--model", "tiny", "--backend", "nccl"]) == 2
    assert asked["world_size"] == 16 and asked["local_world_size"] == 8
