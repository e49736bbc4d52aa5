"""Every bad input is refused before any rank starts: exit 2, one line naming the flag and the value (and
the fix), no rank process spawned, nothing written."""

from __future__ import annotations

import json

import pytest

from harness import cli
from harness.upstream import mbridge_build_refusal

# where the installed mbridge cannot build on the installed megatron-core (mbridge#155), every --engine mbridge run is
# refused with that reason first
_MBRIDGE_REFUSED = "mbridge#155" if mbridge_build_refusal() else ""
CORRUPT = "corrupt-baselines"  # a --baselines-dir whose ckpt-memory file is not JSON (made by the fixture)

# (argv, a piece of the one-line message); {tmp} is the test's empty directory
CASES = [
    (["run", "--suite", "nope"], "unknown suite 'nope'"),
    (["run", "--suite", "step-perff"], "unknown suite 'step-perff'"),
    (["run", "--suite", "peft-ckpt", "--engine", "fsdp2"],
     "engine 'fsdp2' has no export_peft_adapter(path): the peft-ckpt suite needs an engine that trains LoRA adapters"),
    (["run", "--suite", "equivalence", "--model", "gpt5"], "unknown model 'gpt5'; known models: tiny"),
    (["run", "--suite", "batch-split", "--cut", "mbs3"], "cut mbs3: a DP rank's 4 samples (global batch 16 over DP 4) "
                                                         "do not split into micro-batches of 3"),
    (["run", "--suite", "batch-split", "--cut", "tokens"], "cut 'tokens': give mbs<N>"),
    (["run", "--suite", "batch-split", "--loss-agg", "mean"], "loss aggregation 'mean': choose one of token-mean"),
    (["run", "--suite", "batch-split", "--micro-batch-size", "2"], "batch-split cuts the batch itself: give --cut"),
    (["run", "--suite", "batch-split", "--engine", "tests.plants.faulty_engines:_DoneHandle"],
     "engine 'tests.plants.faulty_engines:_DoneHandle' is not a class with train_rl_batch / rl_logprobs"),
    (["run", "--suite", "batch-split", "--world-size", "3"],
     "layout tp1-pp1-cp1-dp3 is invalid for model tiny: global_batch_size=16 not divisible"),
    (["run", "--suite", "batch-split", "--engine", "tests.plants.faulty_batch_split:UnknownLossForm"],
     "engine tests.plants.faulty_batch_split:UnknownLossForm: loss_form 'gathered': give 'chunk'"),
    (["run", "--suite", "batch-split", "--temperature", "0"], "--temperature 0: give a positive temperature"),
    (["run", "--suite", "rl-cycle", "--temperature", "-1"], "--temperature -1: give a positive temperature"),
    (["run", "--suite", "batch-split", "--entropy-coef", "-1"], "--entropy-coef -1: give a coefficient of 0 or more"),
    (["run", "--suite", "batch-split", "--policy-loss", "grpo"], "--policy-loss grpo: give one of nll, ppo-clip"),
    (["run", "--suite", "batch-split", "--vocab-size", "1"], "--vocab-size 1: give a vocabulary of 2 tokens or more"),
    (["run", "--suite", "refit", "--refit-variant", "padded-vocab", "--layout", "tp2-pp1-cp1-dp2", "--engine",
      "megatron-bridge"], "--refit-variant padded-vocab: engine megatron-bridge does not build the vocabulary padded"),
    (["run", "--suite", "batch-split", "--vocab-size", "127", "--engine", "megatron-bridge"],
     "--vocab-size: engine megatron-bridge does not build the vocabulary padded"),
    (["run", "--suite", "batch-split", "--mtp-layers", "5"], "--mtp-layers 5: give 1 to 4 MTP layers"),
    (["run", "--suite", "batch-split", "--mtp-layers", "1", "--policy-loss", "ppo-clip"],
     "--mtp-layers with --policy-loss ppo-clip: the MTP measurements take one forward-backward"),
    (["run", "--suite", "batch-split", "--mtp-layers", "1", "--engine", "fsdp2"],
     "--mtp-layers: engine fsdp2 does not build megatron's MTP layers and measure them"),
    (["run", "--suite", "batch-split", "--temperature", "0.7", "--engine", "tests.plants.faulty_batch_split:RLStepsWithoutAHead"],
     "--temperature 0.7: engine tests.plants.faulty_batch_split:RLStepsWithoutAHead has no log-prob head"),
    (["run", "--suite", "refit", "--temperature", "0"], "--temperature 0: give a positive temperature"),
    (["run", "--suite", "refit", "--bucket-size", "8kb"], "--bucket-size '8kb': expected a positive size with a unit"),
    (["run", "--suite", "refit", "--refits", "1"], "--refits 1: at least 2"),
    (["run", "--suite", "refit", "--engine", "tests.plants.faulty_engines:_DoneHandle"],
     "engine 'tests.plants.faulty_engines:_DoneHandle' has no export_buckets(bucket_bytes)"),
    (["run", "--suite", "refit", "--engine", "mbridge"],
     _MBRIDGE_REFUSED or "engine 'mbridge': mbridge's export_weights maps Transformer Engine's layer names only"),
    (["run", "--suite", "refit", "--engine", "megatron-bridge", "--model", "tiny-moe"],
     "model tiny-moe: megatron-bridge converts a mixture of experts to Hugging Face here as Qwen3-MoE"),
    (["run", "--suite", "rl-cycle", "--iterations", "1"], "--iterations 1: at least 4"),
    (["run", "--suite", "rl-cycle", "--rl-variant", "frozen"], "--rl-variant 'frozen': expected one of built-twice"),
    (["run", "--suite", "rl-cycle", "--rl-variant", "expert-bias", "--layout", "tp1-pp1-cp1-dp4"],
     "--rl-variant expert-bias needs an MoE model"),
    (["run", "--suite", "rl-cycle", "--rl-variant", "lora", "--layout", "tp1-pp1-cp1-dp4"],
     "--rl-variant lora trains LoRA adapters and refits them: --engine mcore has none"),
    (["run", "--suite", "rl-cycle", "--rl-variant", "lora", "--layout", "tp1-pp1-cp1-dp4-ep2", "--model",
      "tiny-qwen3-moe", "--engine", "megatron-bridge"], "--rl-variant lora is judged on a dense model here"),
    (["run", "--suite", "rl-cycle", "--engine", "tests.plants.faulty_engines:_DoneHandle"],
     "engine 'tests.plants.faulty_engines:_DoneHandle' has no record_routing / replay_routing / offload / reload"),
    (["run", "--suite", "equivalence", "--world-size", "0"], "--world-size must be >= 1, got 0"),
    (["run", "--suite", "peft-ckpt", "--model", "tiny-moe"],
     "model tiny-moe: megatron-bridge converts a mixture of experts to Hugging Face here as Qwen3-MoE, which needs "
     "qk_layernorm = true: use --model tiny-qwen3-moe or a model with them"),
    (["run", "--suite", "peft-ckpt", "--model", "tiny-qwen3-moe", "--world-size", "2", "--layout", "tp1-pp1-cp1-dp2-ep2"],
     "layout tp1-pp1-cp1-dp2-ep2: megatron-bridge"),
    (["run", "--suite", "ckpt-memory", "--engine", "fsdp2", "--model", "tiny-moe"],
     "--engine fsdp2 saves FSDP2 checkpoints of dense models only (torch's fully_shard over DP), so ckpt-memory has "
     "no case of it for mixture-of-experts model tiny-moe: run the model with --engine mcore"),
    (["run", "--suite", "equivalence", "--model", "tiny", "--layout", "tp1-pp1-cp1-dp4-ep2"],
     "layout tp1-pp1-cp1-dp4-ep2 is invalid for model tiny: ep=2, etp=1: model tiny has no experts"),
    (["run", "--suite", "equivalence", "--model", "tiny-moe", "--layout", "tp1-pp1-cp1-dp4-ep3"],
     "layout tp1-pp1-cp1-dp4-ep3 is invalid for model tiny-moe: num_experts=4 not divisible by ep=3"),
    (["run", "--suite", "equivalence", "--layout", "tp3-pp1-cp1-dp1"], "layout tp3-pp1-cp1-dp1 is invalid for model tiny"),
    (["run", "--suite", "equivalence", "--layout", "2x2"], "layout '2x2' is not of the form tpT-ppP-cpC-dpD"),
    (["run", "--suite", "equivalence", "--steps", "0"], "--steps must be >= 1, got 0"),
    (["run", "--suite", "equivalence", "--timeout", "-1"], "--timeout must be > 0 seconds, got -1.0"),
    (["run", "--suite", "equivalence", "--seed", "-3"], "--seed must be >= 0, got -3"),
    (["run", "--suite", "equivalence", "--shuffle", "-1"], "--shuffle takes a seed >= 0, got -1"),
    (["run", "--suite", "equivalence", "--engine", "nosuch_pkg.engine:make"],
     "engine 'nosuch_pkg.engine:make': cannot import 'nosuch_pkg'"),
    (["run", "--suite", "equivalence", "--engine", "megatron"], "unknown engine 'megatron'; built-in engines: mcore"),
    (["run", "--suite", "equivalence", "--engine", "harness.engines.mcore:NoSuchEngine"],
     "engine 'harness.engines.mcore:NoSuchEngine': module 'harness.engines.mcore' has no attribute 'NoSuchEngine'"),
    (["run", "--suite", "equivalence", "--backend", "nccl"], "backend nccl needs one GPU per rank: world size 4"),
    (["run", "--suite", "equivalence", "--out", "/proc/forbidden"], "--out /proc/forbidden: cannot write there"),
    (["run", "--suite", "equivalence", "--out", "{tmp}/a-file"], "--out {tmp}/a-file: cannot write there"),
    (["run", "--suite", "step-perf", "--timed-steps", "2"], "--timed-steps must be >= 3 (the statistics need samples), got 2"),
    (["run", "--suite", "step-perf", "--min-effect", "0"], "--min-effect is a fraction of the baseline median"),
    (["run", "--suite", "equivalence", "--timed-steps", "5"], "--timed-steps does not apply to the equivalence suite"),
    (["run", "--suite", "equivalence", "--ckpt-format", "dp_reshardable"],
     "--ckpt-format does not apply to the equivalence suite"),
    (["run", "--suite", "ckpt-memory", "--ckpt-format", "nope"], "unknown checkpoint format(s) ['nope']"),
    (["run", "--suite", "grad-sync", "--async-save"], "--async-save does not apply to the grad-sync suite"),
    (["run", "--suite", "equivalence", "--fully-parallel-save"], "--fully-parallel-save does not apply to the equivalence suite"),
    (["run", "--suite", "ckpt-memory", "--baselines-dir", "{tmp}/" + CORRUPT],
     "baseline file {tmp}/" + CORRUPT + "/cpu-gloo/ckpt-memory.json is corrupt"),
    (["baselines", "record", "--suite", "ckpt-memory", "--repeats", "2"], "--repeats must be >= 3"),
    (["baselines", "check", "--suite", "equivalence"], "suite 'equivalence' has no baselines"),
    (["baselines", "record"], "--suite is required (or, to record what this platform lacks: baselines record --missing)"),
    (["baselines", "check", "--missing"], "--missing records what is missing: `harness baselines record --missing`"),
    (["baselines", "record", "--missing", "--layout", "tp1-pp1-cp1-dp4"],
     "--missing records the models and layouts the regression suites run; drop --layout"),
    (["baselines", "record", "--missing", "--suite", "grad-sync"], "suite 'grad-sync' has no baselines"),
    (["baselines", "record", "--missing", "--repeats", "1"], "--repeats must be >= 3"),
    (["baselines", "check", "--suite", "step-perf", "--baselines-dir", "{tmp}/" + CORRUPT + "-sp"],
     "baseline file {tmp}/" + CORRUPT + "-sp/cpu-gloo/step-perf.json is corrupt"),
    (["layouts", "--world-size", "7", "--model", "tiny"],
     "no layout of world size 7 is valid for model tiny (pure DP tp1-pp1-cp1-dp7: global_batch_size=8 not "
     "divisible by micro_batch_size*dp=7)"),
    (["layouts", "--world-size", "0", "--model", "tiny"], "--world-size must be >= 1, got 0"),
    (["project-memory", "--model", "70b", "--layout", "tp8-pp2-cp1-dp16", "--format", "nope"],
     "--format 'nope': no memory model for it; known: dp_reshardable"),
    (["project-memory", "--model", "70b", "--layout", "tp8-pp2-cp1-dp16", "--ranks-per-node", "0"],
     "--ranks-per-node must be >= 1, got 0"),
    (["nightly", "--out", "/proc/forbidden"], "--out /proc/forbidden: cannot write there"),
    (["nightly", "--out", "{tmp}/n", "--suite", "nope"], "unknown suite(s) ['nope']"),
    (["nightly", "--out", "{tmp}/n", "--world-size", "-2"], "--world-size must be >= 1, got -2"),
    (["report", "{tmp}/" + CORRUPT], "no results.json under {tmp}/" + CORRUPT),
    (["bisect", "--suite", "equivalence", "--metric", "fail", "--max", "abc"], "--max 'abc': give a number"),
    (["bisect", "--suite", "equivalence", "--metric", "fail", "--repo", "{tmp}", "--good", "a", "--bad", "b"],
     "--repo {tmp}: not a git checkout"),
    (["bisect", "--suite", "equivalence", "--metric", "fail", "--steps", "0", "--megatron-core", "0.16.0", "0.16.1"],
     "--steps must be >= 1, got 0"),
    (["compare", "--layout", "tp1-pp1-cp1-dp4"], "give two engines (--engine A --engine B)"),
    (["compare", "--engine", "mcore", "--engine", "mcore", "--rounds", "1"], "--rounds must be >= 2"),
    (["compare", "--engine", "mcore", "--engine", "nosuch_pkg.engine:make"], "cannot import 'nosuch_pkg'"),
    (["compare", "--suite", "equivalence", "--engine", "a", "--engine", "b"], "compare judges step times: --suite step-perf"),
    (["compare", "--engine", "mcore", "--engine", "mcore", "--out", "/proc/forbidden"], "--out /proc/forbidden: cannot write"),
    (["bisect", "--suite", "equivalence", "--metric", "fail", "--package", "megatron-core"],
     "--package takes the distribution then its versions"),
    (["bisect", "--suite", "equivalence", "--metric", "fail", "--package", "megatron-core", "0.16.1",
      "--megatron-core", "0.16.0", "0.16.1"], "give --package NAME VERSIONS or --megatron-core VERSIONS, not both"),
    (["bisect", "--suite", "equivalence", "--metric", "fail"], "give --package NAME VERSIONS (or --megatron-core"),
    (["bisect", "--suite", "equivalence", "--metric", "fail", "--megatron-core", "0.16.0", "0.16.1", "--git-bisect-run"],
     "--git-bisect-run bisects the commits of --repo"),
    (["bisect-step", "--suite", "equivalence", "--metric", "fail", "--timeout", "0"], "--timeout must be > 0 seconds"),
    (["run", "--suite", "equivalence", "--engine", "tests.plants.engine_raises_at_import:make"],
     "engine 'tests.plants.engine_raises_at_import:make': importing 'tests.plants.engine_raises_at_import' raised RuntimeError: "
     "planted: this engine module cannot be imported (fix that module)"),
    (["run", "--suite", "equivalence", "--engine", "tests.plants.fake_suites:CASE_TIMEOUT_S"],
     "tests.plants.fake_suites.CASE_TIMEOUT_S is a float, not a factory"),
    (["project-memory", "--model", "70b", "--layout", "tp8-pp2-cp1-dp16", "--training", "--device-gib", "nan"],
     "--device-gib must be a finite number of GiB > 0 (e.g. 80), got nan"),
    (["project-memory", "--model", "70b", "--layout", "tp8-pp2-cp1-dp16", "--training", "--device-gib", "inf"],
     "--device-gib must be a finite number of GiB > 0 (e.g. 80), got inf"),
    (["project-memory", "--model", "70b", "--layout", "tp8-pp2-cp1-dp16", "--training", "--seq-length", "999999999999"],
     "--seq-length must be between 1 and 4194304 tokens"),
    (["baselines", "check", "--suite", "ckpt-memory", "--baselines-dir", "{tmp}/nowhere"],
     "--baselines-dir {tmp}/nowhere does not exist: give the directory that holds <platform>/ckpt-memory.json"),
    (["run", "--suite", "ckpt-memory", "--baselines-dir", "{tmp}/nowhere"], "--baselines-dir {tmp}/nowhere does not exist"),
    (["bisect-step", "--suite", "ckpt-memory", "--model", "small", "--metric", "rank0.nonsense_metric"],
     "--metric 'rank0.nonsense_metric': the ckpt-memory suite has no such metric; its baselined metrics (N: a rank): "
     "rankN.save_heap_peak_mib"),
    (["bisect", "--suite", "ckpt-memory", "--metric", "rank0.nonsense_metric", "--megatron-core", "0.16.0", "0.16.1"],
     "--metric 'rank0.nonsense_metric': the ckpt-memory suite has no such metric"),
    (["bisect", "--suite", "ckpt-memory", "--metric", "fail", "--megatron-core", "0.16.1..0.15.0"],
     "version range 0.16.1..0.15.0 runs backwards: give the older release first (0.15.0..0.16.1"),
    (["run", "--suite", "equivalence", "--out", "{tmp}/earlier"],
     "--out {tmp}/earlier holds an earlier run (results.json, report.md): give a new directory, or add --force"),
    (["run", "--suite", "grad-sync", "--engine", "fsdp2"],
     "the grad-sync suite judges megatron DDP's gradient-sync modes"),
    (["run", "--suite", "equivalence", "--engine", "fsdp2", "--world-size", "2", "--layout", "tp2-pp1-cp1-dp1"],
     "engine fsdp2 shards over data parallel only: layout tp2-pp1-cp1-dp1 must be tp1-pp1-cp1-dpN (--engine fsdp2 "
     "cannot build --layout tp2-pp1-cp1-dp1"),
    (["run", "--suite", "equivalence", "--engine", "fsdp2", "--model", "tiny-moe", "--layout", "tp1-pp1-cp1-dp4-ep2"],
     "engine fsdp2 shards over data parallel only: layout tp1-pp1-cp1-dp4-ep2"),
    (["run", "--suite", "grad-sync", "--engine", "mbridge", "--model", "tiny-moe"],
     _MBRIDGE_REFUSED or
     "model tiny-moe: megatron-bridge converts a mixture of experts to Hugging Face here as Qwen3-MoE, which needs "
     "qk_layernorm = true: use --model tiny-qwen3-moe or a model with them (--engine mbridge can build no case"),
    (["run", "--suite", "equivalence", "--engine", "megatron-bridge", "--model", "small-moe"],
     "(--engine megatron-bridge can build no case of this selection)"),
    (["run", "--suite", "dynamic-cp", "--engine", "megatron-bridge"],
     "engine 'megatron-bridge' cannot run the dynamic-cp suite: it compares megatron's no, static and dynamic CP"),
    (["history", "ingest", "{tmp}/nowhere"], "{tmp}/nowhere: not a directory"),
    (["bisect", "--megatron-core", "0.16.1", "0.19.2", "--suite", "rl-cycle", "--metric", "check:golden.trajectory"],
     "--metric 'check:golden.trajectory': name a check of the rl-cycle suite"),
    (["nightly", "--out", "{tmp}/n", "--other-stack", "{tmp}/python"], "--other-stack '{tmp}/python': give NAME=PYTHON"),
    (["nightly", "--out", "{tmp}/n", "--other-stack", "old={tmp}/python"], "--other-stack {tmp}/python: cannot run it"),
    (["history", "ingest", "{tmp}", "--db", "/proc/forbidden/h.sqlite"], "--db /proc/forbidden/h.sqlite: cannot"),
    (["history", "show", "--metric", "x", "--db", "{tmp}/none.sqlite"], "history database {tmp}/none.sqlite does not exist"),
    (["history", "show", "--metric", "x", "--db", "{tmp}/a-file"], "is not an SQLite database"),
    (["history", "show", "--metric", "x", "--since", "yesterday", "--db", "{tmp}/a-file"], "--since 'yesterday': give a date"),
    (["nightly", "--out", "{tmp}/night", "--history-db", "{tmp}/a-file"], "history database {tmp}/a-file is not an SQLite"),
    (["report", "{tmp}/run", "--history-db", "{tmp}/none.sqlite"], "--history-db {tmp}/none.sqlite does not exist"),
    (["report", "{tmp}/run", "--history-db", "{tmp}/a-file"], "history database {tmp}/a-file is not an SQLite"),
]



def test_the_table_holds_every_bad_input():
    assert len(CASES) == 117  # one more per bad input added; none dropped without a word


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    """An empty directory (plus the corrupt baseline files the cases name) and spawning forbidden."""
    for sub, suite in ((CORRUPT, "ckpt-memory"), (CORRUPT + "-sp", "step-perf")):
        (tmp_path / sub / "cpu-gloo").mkdir(parents=True)
        (tmp_path / sub / "cpu-gloo" / f"{suite}.json").write_text("{ not json")
    (tmp_path / "a-file").write_text("")
    (tmp_path / "earlier").mkdir()
    for name in ("results.json", "report.md"):
        (tmp_path / "earlier" / name).write_text("{}")
    (tmp_path / "run").mkdir()  # a run's results, which `harness report` would render
    (tmp_path / "run" / "results.json").write_text(json.dumps(
        {"suite": "equivalence", "engine": "mcore", "model": "tiny", "world_size": 4, "cases": [], "checks": []}))

    def no_rank(*args, **kwargs):
        raise AssertionError("a rank process was started for bad input")

    monkeypatch.setattr("harness.launch.runner.spawn_rank", no_rank)  # every rank start, fresh or pooled
    monkeypatch.setattr("harness.launch.zygote.Zygote", no_rank)  # the fork server: only for a valid plan
    monkeypatch.setattr("harness.bisect.version_env", no_rank)  # compare's
    monkeypatch.setattr("harness.bisect.candidates.version_env", no_rank)  # bisect's
    return tmp_path


def _listing(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("argv,message", CASES, ids=[" ".join(a)[:60] for a, _ in CASES])
def test_bad_input_is_refused_before_any_rank(sandbox, capsys, argv, message):
    argv = [a.replace("{tmp}", str(sandbox)) for a in argv]
    before = _listing(sandbox)
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("harness: error: "), err
    assert message.replace("{tmp}", str(sandbox)) in lines[0], lines[0]
    assert _listing(sandbox) == before  # nothing written, no directory left behind
    assert not out.strip()  # nothing half-printed (project-memory's header, a table)


def test_force_replaces_the_earlier_run_and_says_so(tmp_path, capsys):
    from harness.report.directory import refuse_earlier_run

    for name in ("results.json", "report.md", "junit.xml"):
        (tmp_path / name).write_text("{}")
    (tmp_path / "plots").mkdir()
    (tmp_path / "plots" / "a.png").write_text("")
    (tmp_path / "notes.txt").write_text("the user's own")
    refuse_earlier_run(tmp_path, force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]  # the earlier run's files only
    assert "removed the earlier run's results.json, report.md, junit.xml, plots" in capsys.readouterr().err


def test_equivalence_given_only_pure_dp_names_the_layouts_to_add():
    from harness.models import load_model
    from harness.spec import Layout
    from harness.suite_defs import get_suite

    [case] = get_suite("equivalence").cases(load_model("tiny"), 2, [Layout(dp=2)])
    assert case.skip_reason.startswith("equivalence compares every layout with pure DP, and --layout named only pure DP: "
                                "add a layout to compare (valid for tiny at world size 2: tp1-pp1-cp2-dp1"), case.skip_reason


def test_a_corrupt_baseline_outside_git_is_not_told_to_git_checkout(tmp_path):
    from harness import baselines
    from harness.errors import BadInput

    path = tmp_path / "cpu-gloo" / "ckpt-memory.json"
    path.parent.mkdir()
    path.write_text("{ not json")
    with pytest.raises(BadInput) as outside:
        baselines.load(path)
    assert "git checkout" not in str(outside.value) and "re-record it" in str(outside.value)
    tracked = baselines.baseline_path(None, "cpu-gloo", "golden")  # the repository's own file
    with pytest.raises(BadInput) as inside:
        baselines.parse("{ not json", str(tracked))
    assert f"git checkout -- {tracked}" in str(inside.value)


@pytest.mark.parametrize("model", ["tiny", "tiny-moe"])
def test_a_default_matrix_holds_only_the_layouts_the_path_builds(model):
    from harness.driver import plan
    from harness.layouts import default_matrix

    planned = plan("equivalence", model, 4, engine="fsdp2", backend="gloo")
    assert {c.layout.id for c in planned.cases} == {"tp1-pp1-cp1-dp4"}  # FSDP2 shards over DP only
    assert len(default_matrix(planned.cases[0].model, 4)) > 1  # what mcore runs
    ckpt = plan("ckpt-memory", "small", 4, engine="fsdp2", backend="gloo")
    own = [c for c in ckpt.cases if c.engine == "fsdp2" and not c.skip_reason]  # its megatron formats run on mcore
    assert own and all((c.layout.tp, c.layout.pp, c.layout.cp) == (1, 1, 1) for c in own)


@pytest.mark.slow  # starts an interpreter that imports torch and megatron (seconds each)
def test_a_refusal_after_megatron_was_imported_is_one_line_in_a_fresh_process(tmp_path):
    """dynamic-cp probes megatron-core's API while planning; its import-time warnings (Transformer Engine and Apex
    missing) are not part of a refusal's one line."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "harness.cli", "run", "--suite", "dynamic-cp", "--engine",
                           "megatron-bridge"], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={k: v for k, v in __import__("os").environ.items() if k != "PYTHONWARNINGS"})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr
    assert proc.stderr.startswith("harness: error: engine 'megatron-bridge' cannot run the dynamic-cp suite")
