"""rl-cycle: correct RL iterations pass; each planted regression (tests/plants/faulty_rl_cycle.py) fails it with a message
naming the iteration, the layer or tensor, the rank and the figure."""

from __future__ import annotations

import re

import pytest

from harness.driver import plan, run_suite
from harness.errors import BadInput

DP4, EP2 = "tp1-pp1-cp1-dp4", "tp1-pp1-cp1-dp4-ep2"  # the default matrix at world size 4
# The runs below are at world size 2, where every planted fault shows, at about 60% of world size 4's time
DP, EP, TP = "tp1-pp1-cp1-dp2", "tp1-pp1-cp1-dp2-ep2", "tp2-pp1-cp1-dp1"
VARIANTS = ("expert-bias", "replayed-bias", "frozen-router")  # run without offload and twin
QUICK = {"iterations": 4}


def _failed(run) -> dict[str, str]:
    """check -> message of every failed check (the case's error under "error")."""
    out = {c.check: c.message for c in run.checks if c.failed}
    errors = [r.error for r in run.results if r.error]
    if errors:
        out["error"] = errors[0]
    return out


def _faulty(name: str, model: str, layout: str, rl_variant: str = ""):
    return run_suite("rl-cycle", model, 2, [layout], engine=f"tests.plants.faulty_rl_cycle:{name}", backend="gloo",
                     suite_params={**QUICK, "rl_variant": rl_variant})


def test_the_default_matrix_runs_every_kind_with_its_twin():
    dense = plan("rl-cycle", "tiny", 4, backend="gloo").cases
    assert {(c.layout.id, c.params.variant, c.params.weights, c.options.use_distributed_optimizer)
            for c in dense if c.params.offload} == {
        (DP4, "", "", False), (DP4, "", "", True), ("tp2-pp1-cp1-dp2", "", "", False),
        ("tp1-pp2-cp1-dp2", "", "", False), ("tp1-pp2-cp1-dp2-vpp2", "4-layers", "", False),
        (DP4, "", "loaded", True)}
    moe = plan("rl-cycle", "tiny-moe", 4, backend="gloo").cases
    assert {(c.layout.id, c.params.variant, c.params.builds, c.params.offload, c.options.routing_replay,
             c.options.freeze_router) for c in moe if c.params.offload or c.params.variant in VARIANTS} == {
        (EP2, "", 1, True, True, False), (EP2, "", 2, True, True, False),
        ("tp1-pp2-cp1-dp2-ep2", "", 1, True, True, False), ("tp1-pp2-cp1-dp2-vpp2-ep2", "4-layers", 1, True, True, False),
        (EP2, "expert-bias", 1, False, False, False), (EP2, "replayed-bias", 1, False, True, False),
        (EP2, "frozen-router", 1, False, True, True)}
    assert len(moe) == 11  # the expert-bias kinds without a twin
    for cases in (dense, moe):  # every case has its twin
        ids = {c.id for c in cases}
        import dataclasses

        assert all(dataclasses.replace(c, params=c.params.twin()).id in ids for c in cases if c.params.offload)
    loaded = next(c for c in dense if c.params.weights == "loaded")
    assert loaded.options.dtype == "bf16"  # master copies to refresh


@pytest.mark.parametrize("given, said", [
    ({"iterations": 3}, "--iterations 3: at least 4"),
    ({"recompute": "full"}, "--recompute full runs the routers again in backward"),
    ({"rl_variant": "frozen"}, "--rl-variant 'frozen': expected one of"),
    ({"rl_variant": "frozen-router", "model": "tiny"}, "needs an MoE model"),
    ({"rl_variant": "built-twice", "layouts": None}, "--rl-variant built-twice runs that kind of case at the layouts"),
])
def test_bad_parameters_are_refused_before_any_rank(given, said):
    given = dict(given)
    layouts = given.pop("layouts", [DP4])
    model = given.pop("model", "tiny-moe")
    from harness.spec import CaseOptions

    options = CaseOptions(recompute=given.pop("recompute", ""))
    with pytest.raises(BadInput, match=said):
        plan("rl-cycle", model, 4, layouts, backend="gloo", suite_params=given, options=options)


def test_fsdp2_is_refused_before_any_rank():
    """fsdp2 builds torch's fully_shard, not the megatron chunks and DDP buffers rl-cycle builds and offloads: refused
    at the plan (it stopped in the log-prob phase with "'FSDP2Engine' object has no attribute 'model'")."""
    from harness.errors import DoesNotApply

    with pytest.raises(DoesNotApply, match="--engine fsdp2 has no RL cycle here: .* run rl-cycle with --engine mcore"):
        plan("rl-cycle", "tiny", 4, backend="gloo", engine="fsdp2")


def test_an_offload_moves_storages_and_a_reload_brings_their_bytes_back():
    import torch

    from harness.engines.offload import HostStore, census

    store = HostStore(on_cpu=True)
    weight = torch.arange(4096, dtype=torch.float32)
    view = weight[10:20]
    before, ptrs = census(store)
    assert store.move([("weight", weight), ("its view", view)]) == 4096 * 4  # one storage, moved once
    assert weight.untyped_storage().nbytes() == 0
    after, _ = census(store, previous=ptrs)
    assert after.bytes <= before.bytes - 4096 * 4 and not after.new  # the host copy is not counted as the device's
    store.restore()
    assert torch.equal(view, torch.arange(10, 20, dtype=torch.float32))


def test_hashing_an_exported_parameter_leaves_its_storage_resizable():
    """The rollout side hashes what it receives; on CPU ranks an export may hand over the parameter itself, and
    `Tensor.numpy()` would mark its storage not resizable for good - the next offload, which frees a storage by
    resizing it to 0, would then stop the cycle."""
    import hashlib

    import torch

    from harness.probes.weight_stream import digest

    weight = torch.nn.Parameter(torch.arange(12, dtype=torch.float32).reshape(3, 4))
    expected = hashlib.blake2b(weight.detach().clone().reshape(-1).view(torch.uint8).numpy().data, digest_size=16)
    assert digest(weight) == expected.hexdigest() and digest(weight.t()) != digest(weight)
    weight.untyped_storage().resize_(0)  # raises "Trying to resize storage that is not resizable" after a numpy()


def test_the_live_heap_counts_what_is_kept_whatever_holds_it_and_not_what_was_freed():
    """What an export kept is read from the live heap: bytes and tensors alike, not what was freed and cached."""
    import torch

    from harness.probes.heap import live_heap

    start = live_heap()
    assert start is not None  # glibc >= 2.33 here
    kept = [bytes(1 << 20), torch.ones(1 << 18)]  # 1 MiB each
    held = live_heap() - start
    del kept
    assert 2 << 20 <= held < (2 << 20) + (256 << 10) and live_heap() - start < 256 << 10, held


@pytest.mark.slow
@pytest.mark.nightly  # the cpu-suite runs the frozen-router case on tiny-moe; upstream-bias's plants stay in the CI tier
def test_a_frozen_replayed_router_holds_its_bias_and_megatrons_own_update_is_judged_by_the_release():
    """Where megatron-core honours frozen_expert_bias (0.17 and later) the engine marks the frozen router as
    megatron's training loop does and megatron holds the bias: a pass. Where it has no such mark (0.16.1) the move
    is the known upstream defect: inconclusive, naming the issue and the release that fixes it."""
    from harness.upstream import FROZEN_EXPERT_BIAS

    run = run_suite("rl-cycle", "tiny-moe", 2, [EP], backend="gloo",
                    suite_params={**QUICK, "rl_variant": "frozen-router"})
    assert not _failed(run)
    upstream = [c for c in run.checks if c.check == "rl-cycle.upstream-bias"]
    assert upstream
    if FROZEN_EXPERT_BIAS.present():
        assert all(c.inconclusive and "known upstream defect (NVIDIA/Megatron-LM#4785)" in c.message
                   and f"fixed in megatron-core {FROZEN_EXPERT_BIAS.fixed_in}" in c.message for c in upstream)
    else:
        assert all(c.passed and "frozen_expert_bias set" in c.message for c in upstream), upstream
    assert sum(c.check == "rl-cycle.replay" and c.passed for c in run.checks) == 1


@pytest.mark.slow
def test_a_frozen_router_left_unmarked_fails_where_megatron_has_the_mark():
    from harness.upstream import FROZEN_EXPERT_BIAS

    run = _faulty("FrozenRouterUnmarked", "tiny-moe", EP, "frozen-router")
    (check,) = [c for c in run.checks if c.check == "rl-cycle.upstream-bias"]
    if FROZEN_EXPERT_BIAS.present():  # the release has no mark: the move is megatron's known defect
        assert check.inconclusive and "NVIDIA/Megatron-LM#4785" in check.message
    else:
        assert check.failed and "the routers were not marked when frozen" in check.message, check.message


@pytest.mark.slow
@pytest.mark.nightly  # upstream-bias's CI-tier plant: a frozen router left unmarked
def test_megatron_ignoring_the_frozen_mark_fails_where_it_has_the_mark():
    from harness.upstream import FROZEN_EXPERT_BIAS

    if FROZEN_EXPERT_BIAS.present():
        pytest.skip(f"megatron-core here has no frozen_expert_bias mark to ignore ({FROZEN_EXPERT_BIAS.said()})")
    run = _faulty("MarkIgnoredByMegatron", "tiny-moe", EP, "frozen-router")
    (check,) = [c for c in run.checks if c.check == "rl-cycle.upstream-bias"]
    assert check.failed and "although its frozen_expert_bias was set" in check.message, check.message


@pytest.mark.slow
def test_a_second_builds_routers_left_in_the_replay_list_are_caught():
    msg = _failed(_faulty("SecondBuildStaysInReplay", "tiny-moe", EP, "built-twice"))["rl-cycle.replay"]
    assert "rank 0 after the build: RouterReplay lists 4 routers, 2 of them this rank's 2 live ones" in msg


@pytest.mark.slow
@pytest.mark.nightly  # rl-cycle.replay's CI-tier plant: a second build's routers left in the replay list
def test_replay_that_routes_by_fresh_scores_is_caught():
    msg = _failed(_faulty("ReplayRoutesByFreshScores", "tiny-moe", EP))["rl-cycle.replay"]
    assert "mini-batch 2" in msg and "decoder.layers." in msg and "tokens routed to other experts than the " \
        "log-prob pass recorded" in msg


@pytest.mark.slow
def test_an_expert_bias_updated_under_a_frozen_router_is_caught():
    # replayed routing: megatron's own frozen_expert_bias (0.19) marks only a frozen router, so the framework must
    # hold the bias on every release
    msg = _failed(_faulty("ExpertBiasUpdatedWhenFrozen", "tiny-moe", EP, "replayed-bias"))["rl-cycle.expert-bias"]
    assert msg.startswith("iteration 1, mini-batch 1, decoder.layers.") and "the expert bias moved by" in msg
    assert "while routing is replayed" in msg


@pytest.mark.slow
def test_a_dispatcher_that_keeps_its_routing_across_offload_is_caught():
    msg = _failed(_faulty("DispatcherKeepsRouting", "tiny-moe", EP))["rl-cycle.offload"]
    assert msg.startswith("iteration 4, rank ") and "tensors more after the offload than after iteration 2's, more " \
        "at every iteration" in msg and "decoder.layers.0.mlp.token_dispatcher.kept[]" in msg


@pytest.mark.slow
def test_a_reload_that_skips_the_master_copies_is_caught():
    msg = _failed(_faulty("ReloadSkipsMasterCopies", "tiny", DP, "weights-only-load"))["rl-cycle.reload"]
    assert msg.startswith("iteration 1, rank 0: the reload did not bring back") and "optimizer 0 parameter" in msg


@pytest.mark.slow
def test_a_weights_only_load_that_leaves_the_master_copies_stale_is_caught():
    msg = _failed(_faulty("LoadLeavesMastersStale", "tiny", DP, "weights-only-load"))["rl-cycle.load"]
    assert "iteration 1, mini-batch 2, rank 0: loss sum" in msg
    assert "the optimizer's master copies did not follow the loaded weights" in msg


@pytest.mark.slow
def test_an_export_that_resends_its_first_stream_fails_rl_cycle_and_passes_refit():
    """Every iteration's export must equal the parameters that iteration trained: a refit that re-sends the first
    iteration's packed buffers fails at iteration 2, naming the tensor and where its bytes come from. `refit` alone,
    which exports twice with no training between, passes it on every check but its baseline (none is recorded for a user engine)."""
    msg = _failed(_faulty("ResendsFirstStream", "tiny", DP))["rl-cycle.refit"]
    assert re.fullmatch(r"iteration 2 of 4: tiny at tp1-pp1-cp1-dp2: rank 0, bucket \d+: \S+ unlike the trained "
                        r"parameter \(largest difference [\d.e-]+\): the rollout gets other weights; its stream is "
                        r"iteration 1's, byte for byte: an export cached and sent again", msg), msg
    run = run_suite("refit", "tiny", 2, [DP], engine="tests.plants.faulty_rl_cycle:ResendsFirstStream", backend="gloo")
    failed = {c.check: c.message for c in run.checks if c.failed}
    assert set(failed) == {"refit.baseline"} and "no baseline for" in failed["refit.baseline"], failed  # a user engine's
    assert {c.check for c in run.checks if c.passed} == {"refit.complete", "refit.values", "refit.memory",
                                                         "refit.repeat", "refit.policy"}


@pytest.mark.slow
def test_an_export_that_keeps_what_it_sent_fails_naming_what_it_kept_per_iteration():
    """A sender that keeps every refit's serialized buckets (bytes, no tensor: the offload's census cannot see them)
    keeps the stream's 321 KiB at every export: `refit` names the rank and what each iteration's export kept."""
    failed = _failed(_faulty("KeepsWhatItSent", "tiny", DP))
    msg = failed.pop("rl-cycle.refit")
    assert re.fullmatch(r"iterations 2-4 of 4: tiny at tp1-pp1-cp1-dp2: rank \d: every export from the second on kept "
                        r"memory once it ended \((\d{3}, ){2}\d{3} KiB, above 256 KiB each\): what the export holds "
                        r"grows with every refit \(buffers kept past the send: serialized buckets, IPC handles, host "
                        r"copies\)", msg), msg
    assert all(321 <= int(k) < 512 for k in re.findall(r"\d{3}(?=[,)]| KiB, above)", msg.split("(")[1])), msg
    assert not failed, failed  # the census counts tensors: the offload sees nothing left


def _head(name: str, temperature: float, layout: str = TP):
    """A plant in the log-prob head; at TP 2 (the vocabulary sharded) where it is the one that needs it, else at DP 2:
    a TP 2 run of rl-cycle costs three times a DP 2 one on CPU ranks (TP's all-reduces over gloo)."""
    return run_suite("rl-cycle", "tiny", 2, [layout], engine=f"tests.plants.faulty_logprobs:{name}", backend="gloo",
                     suite_params={**QUICK, "temperature": temperature})


def _policy_failure(what: str, temperature: str, figure: str, layout: str = TP) -> str:
    return (rf"iteration 2 of 4: tiny at {layout}{temperature}: {what} from iteration 1's export differs from the "
            rf"log-prob pass(?:'s)? at \d+/512 (?:tokens|positions) \(worst rel {figure} > 1e-05\): the ")


@pytest.mark.slow
def test_log_probs_and_entropy_at_a_temperature_are_the_rollouts_at_tp2():
    """The engine's log-prob head at temperature 0.7 over TP 2's vocabulary shards: the Hugging Face model loaded from
    each export, at the same temperature, gives the trainer's log-probs and entropies."""
    run = run_suite("rl-cycle", "tiny", 2, [TP], backend="gloo", suite_params={**QUICK, "temperature": 0.7})
    assert run.passed, _failed(run)
    msg = next(c.message for c in run.checks if c.check == "rl-cycle.policy")
    assert re.fullmatch(r"tiny at tp2-pp1-cp1-dp1, temperature 0\.7: at each of 3 iterations the Hugging Face model "
                        r"loaded from the iteration's export computes the next log-prob pass \(1536 tokens\), worst rel "
                        r"per iteration \S+, \S+, \S+ <= 1e-05; its entropy too, worst rel \S+", msg), msg


@pytest.mark.slow
@pytest.mark.nightly  # the same plant fails refit.policy in the CI tier (test_refit.py); rl-cycle.policy's: the entropy's
def test_a_temperature_applied_twice_fails_the_policy():
    msg = _failed(_head("TemperatureTwice", 0.7))["rl-cycle.policy"]
    assert re.match(_policy_failure("the Hugging Face model loaded", ", temperature 0.7", r"[1-9]\.\d+e-02"), msg), msg


@pytest.mark.slow
def test_entropy_on_unscaled_logits_fails_the_policy_on_entropy():
    msg = _failed(_head("EntropyOnUnscaledLogits", 0.7, DP))["rl-cycle.policy"]
    assert re.match(_policy_failure("the entropy of the Hugging Face model loaded", ", temperature 0.7",
                                    r"\d\.\d+e-0[23]", DP), msg), msg
    assert "the trainer's entropy is not the rollout policy's" in msg


@pytest.mark.slow
@pytest.mark.nightly  # rl-cycle.policy's CI-tier plants through the head: the entropy on unscaled logits, TP 2
def test_labels_shifted_once_more_fail_the_policy():
    msg = _failed(_head("LabelShiftOffByOne", 1.0, DP))["rl-cycle.policy"]
    assert re.match(_policy_failure("the Hugging Face model loaded", "", r"\S+", DP), msg), msg


@pytest.mark.slow
def test_an_export_before_the_iterations_optimizer_step_fails():
    """The stream is the previous policy's: unlike the trained parameters (`refit`), and the Hugging Face model
    loaded from it, the rollout's stand-in, scores the next batch otherwise than the trainer's log-prob pass
    (`policy`)."""
    failed = _failed(_faulty("ExportsBeforeTheStep", "tiny", DP))
    msg = failed["rl-cycle.refit"]
    assert re.fullmatch(r"iteration 1 of 4: tiny at tp1-pp1-cp1-dp2: rank 0, bucket \d+: \S+ unlike the trained "
                        r"parameter \(largest difference [\d.e-]+\): the rollout gets other weights", msg), msg
    msg = failed["rl-cycle.policy"]
    assert re.fullmatch(r"iteration 2 of 4: tiny at tp1-pp1-cp1-dp2: the Hugging Face model loaded from iteration 1's "
                        r"export differs from the log-prob pass at \d+/512 tokens \(worst rel \S+ > 1e-05\): the "
                        r"rollout samples with another policy than the trainer scores; first: sample \d+", msg), msg


@pytest.mark.slow
@pytest.mark.nightly  # rl-cycle.refit's CI-tier plants: the first stream re-sent, an export before the step
def test_an_export_that_reads_parameters_the_optimizer_offload_took_fails():
    """Colocated order: the optimizer's state leaves before the export. An optimizer offload that takes the model's
    own parameters with it (fp32 without master copies) leaves the export nothing but freed storage; exported before
    any offload (`--rl-variant export-first`), the same engine's refits are right."""
    failed = _failed(_faulty("OptimizerOffloadTakesTheParams", "tiny", DP))
    assert re.fullmatch(r"iteration 1 of 4: tiny at tp1-pp1-cp1-dp2: rank 0: \S+ \(\d+(, \d+)*\) and \d+ more had left "
                        r"the device when the export was due \(after the optimizer's offload\): the export would read "
                        r"freed storage, so none ran; the optimizer's offload must leave the model's own parameters "
                        r"for the export", failed["rl-cycle.refit"]), failed["rl-cycle.refit"]
    first = _faulty("OptimizerOffloadTakesTheParams", "tiny", DP, "export-first")
    assert {c.check for c in first.checks if c.passed} >= {"rl-cycle.refit", "rl-cycle.policy"}, _failed(first)


def _lora(plant: str = ""):
    """LoRA in the loop (megatron-bridge's LoRA on every linear, bf16) at pure DP: the case and its twin."""
    if plant:
        return _faulty(plant, "tiny", DP, "lora")
    return run_suite("rl-cycle", "tiny", 2, [DP], engine="megatron-bridge", backend="gloo",
                     suite_params={**QUICK, "rl_variant": "lora"})


@pytest.mark.slow
@pytest.mark.nightly  # the cpu-suite runs it (suites/test_rl_cycle.py, lora_run)
def test_lora_refits_merged_and_adapter_only_at_every_iteration():
    """The merged refit equals W + (alpha / r) B A computed in fp32 and cast once to bf16, bit for bit, ten refits in a
    row alike; the Hugging Face model loaded from it and peft serving the adapter-only refit over the base weights
    both compute the next log-prob pass within bf16's tolerance, at every iteration."""
    run = _lora()
    assert not _failed(run), _failed(run)
    for check in ("refit", "policy", "adapter"):
        assert sum(c.check == f"rl-cycle.{check}" and c.passed for c in run.checks) == 2, check
    adapter = next(c.message for c in run.checks if c.check == "rl-cycle.adapter")
    assert re.fullmatch(r"tiny at tp1-pp1-cp1-dp2: at each of 3 iterations peft serving the iteration's adapter over "
                        r"the base weights computes the next log-prob pass \(1536 tokens\), worst rel per iteration "
                        r"\S+, \S+, \S+ <= 2e-02; each adapter sent equals the one trained, bit for bit", adapter), adapter


@pytest.mark.slow
@pytest.mark.nightly  # LoRA in the loop keeps one CI-tier plant: the scaling folded into B
def test_a_lora_merge_computed_in_bf16_term_by_term_fails_refit():
    msg = _failed(_lora("MergesInBf16TermByTerm"))["rl-cycle.refit"]
    assert re.fullmatch(r"iteration 1 of 4: tiny at tp1-pp1-cp1-dp2: rank 0, bucket \d+: model\.layers\.0\.\S+ unlike "
                        r"the trained parameter \(largest difference [\d.e-]+\): the rollout gets other weights", msg), msg


@pytest.mark.slow
@pytest.mark.nightly  # LoRA in the loop keeps one CI-tier plant: the scaling folded into B
def test_a_lora_merge_applied_again_at_every_refit_fails_refit():
    msg = _failed(_lora("MergesIntoTheBaseAtEveryRefit"))["rl-cycle.refit"]
    assert re.fullmatch(r"iteration 1 of 4: tiny at tp1-pp1-cp1-dp2: rank \d: refit 2 of 10 in a row, with no training "
                        r"between, differs from the first at model\.layers\.0\.\S+ \(bucket \d+\): the merge is applied "
                        r"again at every refit \(the adapters merged into the base weights in place\?\)", msg), msg


@pytest.mark.slow
def test_a_lora_scaling_folded_into_b_fails_the_adapter_only_refit():
    """B sent with alpha / r folded in, the config keeping lora_alpha: unlike the trained adapter, tensor by tensor
    (peft's log-probs move by 4e-2 at 8 of 512 tokens in bf16, near its tolerance: the tensors are what show it)."""
    failed = _failed(_lora("FoldsTheScalingIntoB"))
    assert set(failed) == {"rl-cycle.adapter"}, failed  # rl-cycle.refit, the merged form, passes
    assert re.fullmatch(r"iteration 1 of 4: tiny at tp1-pp1-cp1-dp2: the adapter-only refit sends base_model\.model\."
                        r"model\.layers\.0\.\S+\.lora_B\.weight unlike the trained adapter \(largest difference "
                        r"[\d.e-]+\): the rollout's peft serves other adapters", failed["rl-cycle.adapter"]), failed


@pytest.mark.slow
def test_a_reload_that_loses_the_low_bits_of_the_weights_fails_the_export_after_it():
    """Every storage comes back, resident and shaped (`reload` passes); the weights do not: the export after the
    reload differs from the one before the offload, the trainer scores the next batch with other weights than the
    rollout got (`policy`), and the trajectory leaves the one without offload."""
    failed = _failed(_faulty("ReloadsThroughBf16", "tiny", DP))
    assert "rl-cycle.reload" not in failed and {"rl-cycle.policy", "rl-cycle.trajectory"} <= set(failed), failed
    assert failed["rl-cycle.policy"].startswith("iteration 2 of 4: tiny at tp1-pp1-cp1-dp2: the Hugging Face model "
                                                "loaded from iteration 1's export differs from the log-prob pass at ")
    assert re.fullmatch(r"iteration 1 of 4: tiny at tp1-pp1-cp1-dp2: rank \d: the export after the reload differs from "
                        r"the one before the offload at \S+ \(bucket \d+\): the reload did not bring back the weights "
                        r"that were offloaded", failed["rl-cycle.refit"]), failed["rl-cycle.refit"]


@pytest.mark.slow
@pytest.mark.nightly  # rl-cycle.refit's CI-tier plants: the first stream re-sent, an export before the step
def test_an_export_the_rollout_cannot_load_fails_refit_and_policy():
    failed = _failed(_faulty("ExportsAnExtraKey", "tiny", DP))
    assert "sent what the harness's mapping has no key for: model.layers.0.mlp.leftover.weight" in \
        failed["rl-cycle.refit"], failed
    assert re.fullmatch(r"iteration 1 of 4: tiny at tp1-pp1-cp1-dp2: the stream does not load into the Hugging Face "
                        r"model strictly: missing \[\], unexpected \['model.layers.0.mlp.leftover.weight'\]: the rollout "
                        r"could not load the export", failed["rl-cycle.policy"]), failed["rl-cycle.policy"]


@pytest.mark.slow
def test_an_engine_whose_export_cannot_run_is_not_judged_on_it():
    """The engine says its export cannot run for the case (RefusesExports, as refit asks): nothing is exported and
    neither export check passes or fails for it; the rest of the cycle is judged."""
    run = _faulty("RefusesItsExport", "tiny", DP)
    checks = {c.check: c for c in run.checks}
    for name in ("rl-cycle.refit", "rl-cycle.policy"):
        assert checks[name].inconclusive and checks[name].message.endswith(
            "planted: this export names Transformer Engine's layers only"), checks[name].message
    assert run.verdict == "pass" and checks["rl-cycle.trajectory"].passed


@pytest.mark.parametrize("release,modules", [
    (None, ()), ("4.46.3", ("transformers", "transformers.models.llama.modeling_llama")),
    ("5.12.1", ("transformers", "transformers.models.llama.modeling_llama",
                "transformers.models.qwen3_moe.modeling_qwen3_moe")),
])
def test_the_hugging_face_modules_a_fork_server_imports_are_the_installed_ones(monkeypatch, release, modules):
    """Without transformers a suite's fork server imports none (its Hugging Face side says it cannot tell); Qwen3-MoE's
    modeling module exists from transformers 4.51."""
    from importlib.metadata import PackageNotFoundError

    from harness.engines.hf_policy import hf_model_modules

    def version(name):
        if release is None:
            raise PackageNotFoundError(name)
        return release

    monkeypatch.setattr("importlib.metadata.version", version)
    assert hf_model_modules() == modules
