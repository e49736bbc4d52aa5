"""A rank's RL iterations: the log-prob pass, two training steps with its routing replayed, the export to the rollout
engine, offload and reload. The order is a colocated framework's: the optimizer's state offloaded, the export, the
parameters offloaded (`export_first`: the export before any offload)."""

from __future__ import annotations

import dataclasses
from typing import Any

from harness.engines.base import ExportsWeights, PeftExporting, RefusesExports, StepOutput
from harness.engines.hf_policy import StreamDoesNotLoad, adapter_policy_logprobs, policy_logprobs
from harness.engines.lora import read_adapter_dir
from harness.engines.offload import HostStore, census, not_resident_params
from harness.engines.rl_batch import Cut, microbatch_samples, rl_batch
from harness.engines.rl_cycle import routers
from harness.engines.weight_export import expert_biases, export_reference
from harness.launch.context import RankContext
from harness.probes.heap import live_heap
from harness.probes.weight_stream import receive
from harness.spec import Case
from harness.suite_defs.rl_cycle.params import LORA_REFITS, MINI_BATCHES, MODE, REFIT_BUCKET, RLCycleCaseParams
from harness.suite_defs.rl_cycle.payload import Iteration, Offloaded, Refit

# What an offload may leave on the device besides the model's registered buffers (rotary frequencies, an expert
# bias and its token counts) and what the MoE dispatchers keep of the last micro-batch: megatron's own small
# bookkeeping tensors (its RNG tracker's states, the MoE loss tracker's). tiny and tiny-moe leave 2-13 KiB of it
# on CPU ranks.
FIXED_RESIDUE = 64 << 10
# What a tensor rank 0 keeps of the stream costs the heap beyond its bytes (its C++ tensor and storage objects):
# measured about 380 bytes on torch 2.13
TENSOR_OVERHEAD = 512
# What megatron's schedules keep of one micro-batch's activations per model chunk once a step is over (the
# interleaved schedule: two [seq, 1, hidden] tensors of the last micro-batch per virtual stage), in [seq, hidden]
# tensors: 4.
ACTIVATIONS = 4


def run_cycle(engine: Any, case: Case, p: RLCycleCaseParams, ctx: RankContext, refused: str = ""
              ) -> tuple[list[StepOutput], list[Iteration], list[dict[str, Any]]]:
    """The case's iterations; refused: why the engine's export cannot run for the case ('' where it can)."""
    from megatron.core import parallel_state as ps

    def biases() -> dict[str, Any]:
        return {k: v.detach().cpu().clone() for m in engine.models for k, v in expert_biases(m.module).items()}

    def batch_of(i: int) -> tuple[Any, list[list[int]]]:
        """Iteration i's batch and this DP rank's micro-batches of it, one sample each."""
        batch = rl_batch(case.model, case.global_batch_size, case.options.seed, i)
        return batch, microbatch_samples(batch, Cut("mbs", 1), case.layout.dp, case.layout.pp,
                                         ps.get_data_parallel_rank())

    replay = case.options.routing_replay
    steps: list[StepOutput] = []
    iterations: list[Iteration] = []
    store = HostStore(ctx.on_cpu)
    offloading = engine.offloading()
    owners = holders(engine)
    previous: set[int] | None = None
    rollout: dict[str, Any] = {}  # rank 0: the rollout's stand-in, built once
    for i in range(p.iterations):
        batch, mbs = batch_of(i)
        cut = len(mbs) // MINI_BATCHES
        with ctx.phase("logprobs"):
            logprobs, recorded = engine.record_routing(batch, mbs)
        seen = [biases()]
        used = []
        train_logprobs: list = []
        for k in range(MINI_BATCHES):
            stop = None if k == MINI_BATCHES - 1 else (k + 1) * cut
            with ctx.phase("steps"):
                out, routing = engine.replay_routing(batch, mbs[k * cut:stop],
                                                     recorded.part(k * cut, stop) if replay else None, MODE,
                                                     capture=k == 0)
            steps.append(out)
            used.append(routing)
            seen.append(biases())
            if k == 0:
                train_logprobs = out.token_logprobs or []
                out.token_logprobs = None
        kept = [t for t in logprobs if _first_minibatch(t, mbs[:cut])]
        exports = isinstance(engine, ExportsWeights) and not refused
        lora = exports and bool(case.options.lora_dim) and isinstance(engine, PeftExporting)
        trained = export_reference(engine) if exports else []  # what the export must equal, before any offload
        colocated = p.offload and not p.export_first
        if colocated:  # the optimizer's state leaves first; the parameters stay for the export
            with ctx.phase("offload"):
                offloading.optimizer(store)
        refit = None
        if exports:
            with ctx.phase("refit"):
                refit = export(engine, ctx.rank, trained)
                if lora and refit.sent and i == 0:  # no training between: the merged weights must not move
                    refit = dataclasses.replace(refit, repeats=[receive(engine.export_buckets(REFIT_BUCKET))
                                                                for _ in range(LORA_REFITS - 1)])
            if refit.stream is not None and i + 1 < p.iterations:  # the last iteration has no next batch scored
                with ctx.phase("hf"):  # the rollout's stand-in samples the next iteration's batch with this policy
                    refit = dataclasses.replace(refit, **rollout_policy(case, refit.stream, batch_of(i + 1)[0],
                                                                        rollout))
            if lora and refit.sent and i + 1 < p.iterations:
                with ctx.phase("hf"):  # the adapter-only form, served by peft over the base weights
                    refit = dataclasses.replace(refit, **adapter_refit(engine, case, ctx, i, batch_of(i + 1)[0],
                                                                       rollout))
        offloaded = None
        if p.offload:
            with ctx.phase("offload"):
                if not colocated:
                    offloading.optimizer(store)
                offloading.params(store)
                left = offloading.offloaded()
                ours = [batch, iterations, logprobs, kept, train_logprobs, recorded, used, seen, steps, refit, trained,
                        [t for v in rollout.values() for t in (v if isinstance(v, dict) else v.state_dict()).values()]]
                now, previous = census(store, exempt=ours, previous=previous, owners=owners)
                offloading.reload(store)
                offloaded = Offloaded(left, now.bytes, now.storages, now.largest, offloading.not_resident(), now.new,
                                      now.allocated)
            if refit is not None and not offloaded.not_back:
                with ctx.phase("refit"):  # what the next iteration's rollout would get, were it exported now
                    refit = dataclasses.replace(refit, after_reload=receive(engine.export_buckets(REFIT_BUCKET)))
        iterations.append(Iteration(kept, train_logprobs, recorded, used, seen, offloaded, refit))
        if offloaded is not None and offloaded.not_back:
            break  # a step on what did not come back reads freed storage: the cycle ends here, judged as it is
    probe: list[dict[str, Any]] = []
    complete = all(it.offload is None or not it.offload.not_back for it in iterations)
    if case.options.freeze_router and case.model.moe_expert_bias and complete:
        # megatron's own update with the router frozen: a step with nothing held and nothing replayed
        batch, mbs = batch_of(p.iterations)
        probe.append(biases())
        with ctx.phase("steps"):
            steps.append(engine.train_rl_batch(batch, mbs, MODE))
        probe.append(biases())
    return steps, iterations, probe


def export(engine: Any, rank: int, trained: list[Any]) -> Refit:
    """The iteration's export as the rollout engine receives it, with the parameters it must equal (`trained`, taken
    before any offload); rank 0 keeps the stream whole. Where a parameter has left the device on any rank, nothing is
    exported (it would read freed storage): the names go to the judge."""
    import torch.distributed as dist

    gone = not_resident_params(engine.models)
    every: list[list[str]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(every, gone)
    if any(every):  # every rank skips it together (it is collective); the ranks that lost parameters name them
        return Refit([], trained, read_offloaded=gone)
    keep: dict[str, Any] | None = {} if rank == 0 else None
    before = _held()
    sent = receive(engine.export_buckets(REFIT_BUCKET), keep)
    after = _held()
    ours = sum(t.untyped_storage().nbytes() + TENSOR_OVERHEAD for t in (keep or {}).values())
    return Refit(sent, trained, keep, kept=None if before is None or after is None else after - before - ours)


def _held() -> int | None:
    """What the rank holds now, garbage collected first: the process's live heap (None where libc cannot say), and on
    GPU ranks torch's allocated device memory too. Read around an export, it is what the export kept once it ended."""
    import gc

    import torch

    gc.collect()
    heap = live_heap()
    if heap is None or not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return heap
    torch.cuda.synchronize()  # blocks freed on other streams are counted until their events complete
    return heap + torch.cuda.memory_allocated()


def adapter_refit(engine: Any, case: Case, ctx: RankContext, i: int, batch: Any, built: dict[str, Any]
                  ) -> dict[str, Any]:
    """The adapter-only refit (collective): the engine's HF PEFT export of iteration i's adapter; on rank 0 the next
    iteration's batch through the Hugging Face model holding the base weights (the engine's export of them without
    the adapters, taken once: they are frozen) with the adapter loaded by peft."""
    import torch.distributed as dist

    path = ctx.workdir / f"adapter-{i}"
    engine.export_peft_adapter(str(path))
    if "base" not in built:
        base = engine.hf_base_state_dict(ctx.workdir)
        built["base"] = base if ctx.rank == 0 else {}
    dist.barrier()
    if ctx.rank != 0:
        return {}
    config, tensors = read_adapter_dir(path)
    sent = {"adapter_tensors": {k: v.clone() for k, v in tensors.items()}, "adapter_config": config}
    try:
        logprobs, why = adapter_policy_logprobs(case.model, case.options.dtype, built["base"], str(path),
                                                batch.tokens, case.params.temperature)
    except StreamDoesNotLoad as exc:
        return {**sent, "adapter_error": f"the adapter-only refit does not load: {exc}"}
    return {**sent, "adapter_policy": logprobs, "adapter_none": why}


def export_refusal(engine: Any, case: Case) -> str:
    """Why the engine's export cannot run for this case ('' where it can): what it says of itself
    (RefusesExports), as the refit suite asks before planning."""

    return (engine.export_refusal(case.model, case.backend) or "") if isinstance(engine, RefusesExports) else ""


def rollout_policy(case: Case, stream: dict[str, Any], batch: Any, built: dict[str, Any]) -> dict[str, Any]:
    """Rank 0: the next iteration's batch through the Hugging Face model loaded from the iteration's export (built
    once per case, in `built`)."""

    try:
        logprobs, entropy, why = policy_logprobs(case.model, case.options.dtype, stream, batch.tokens, built,
                                                 case.params.temperature)
    except StreamDoesNotLoad as exc:
        return {"policy_error": f"the stream does not load into the Hugging Face model strictly: {exc}"}
    return {"policy": logprobs, "policy_entropy": entropy, "policy_none": why}


def _first_minibatch(part: Any, first: list[list[int]]) -> bool:
    """Whether a log-prob pass micro-batch is one of the first mini-batch's."""
    samples = [int(s) for s in part.samples]
    return samples in first


def residue_bound(engine: Any, case: Case) -> int:
    """What an offload may leave on this rank's device: the chunks' registered buffers, megatron's global memory
    buffer (kept for its collectives), what each MoE layer's dispatcher keeps of one micro-batch (its routing map and
    probabilities, its token counts) and FIXED_RESIDUE."""
    from megatron.core import parallel_state as ps

    kept = [b for m in engine.models for b in m.module.buffers() if b is not None]
    kept += list(ps.get_global_memory_buffer().buffer.values())
    bufs = {b.untyped_storage().data_ptr(): b.untyped_storage().nbytes() for b in kept}
    m = case.model
    tokens = m.seq_length  # one sample per micro-batch
    per_layer = tokens * m.num_experts * (1 + 4 + 8) + m.num_experts * 8 if m.moe else 0
    moe_layers = len(routers([c.module for c in engine.models]))
    return (sum(bufs.values()) + moe_layers * per_layer + len(engine.models) * ACTIVATIONS * tokens * m.hidden_size * 4
            + FIXED_RESIDUE)


def holders(engine: Any) -> dict[int, str]:
    """id -> name of the objects whose attributes may hold what an offload leaves: every module of the chunks (as
    named in its chunk) and each MoE layer's token dispatcher."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    out: dict[int, str] = {}
    for i, model in enumerate(engine.models):
        prefix = f"chunk {i}: " if len(engine.models) > 1 else ""
        for name, m in model.module.named_modules():
            out[id(m)] = prefix + (name or "model")
            if isinstance(m, MoELayer):
                out[id(m.token_dispatcher)] = f"{prefix}{name}.token_dispatcher"
    return out

