"""RL-cycle engines with planted regressions, each one seen in 2026's RL frameworks (the rl-cycle suite)."""

from __future__ import annotations

import contextlib

from harness.engines.mcore import McoreEngine
from harness.engines.megatron_bridge import MegatronBridgeEngine
from harness.engines.offloading import Offloading


class SecondBuildStaysInReplay(McoreEngine):
    """verl #7340: the bridge builds the decoder twice and the first build's routers stay in RouterReplay's
    process-wide list (2N entries: replay data set by position reaches the wrong routers)."""

    def before_build(self) -> None:
        pass


class ReplayRoutesByFreshScores(McoreEngine):
    """Replay that sets the recorded indices as targets but routes by fresh scores (the action left at RECORD)."""

    def replay_action(self):
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        return RouterReplayAction.RECORD


class ExpertBiasUpdatedWhenFrozen(McoreEngine):
    """Megatron-LM #4785, prime-rl #2953: the aux-loss-free expert bias keeps updating with the router frozen and
    its routing replayed (nothing holds it)."""

    @contextlib.contextmanager
    def hold_expert_bias(self, replayed: bool):
        yield


class FrozenRouterUnmarked(McoreEngine):
    """A framework that freezes the router's weight but never sets megatron's frozen_expert_bias (what megatron's
    own training loop sets with the router frozen): where megatron-core has the mark, its update moves the bias."""

    def after_build(self, chunks: list) -> None:
        from harness.engines.rl_cycle import routers

        if self.case.options.freeze_router:
            for router in routers(chunks):
                router.weight.requires_grad_(False)


class MarkIgnoredByMegatron(McoreEngine):
    """megatron-core's expert-bias update ignoring a router's frozen_expert_bias mark (the mechanism of
    Megatron-LM#4785 broken again): the mark is set, and the update runs as if it were not."""

    def train_rl_batch(self, *args, **kwargs):
        import importlib

        from harness.engines.rl_cycle import routers

        fmg = importlib.import_module("megatron.core.distributed.finalize_model_grads")  # the module, not the function

        original = fmg._update_router_expert_bias
        live = routers([m.module for m in self.models])

        def ignoring(*a, **k):
            marks = [vars(r).get("frozen_expert_bias") for r in live]
            for r in live:
                r.frozen_expert_bias = False
            try:
                return original(*a, **k)
            finally:
                for r, mark in zip(live, marks):
                    r.frozen_expert_bias = mark

        fmg._update_router_expert_bias = ignoring
        try:
            return super().train_rl_batch(*args, **kwargs)
        finally:
            fmg._update_router_expert_bias = original


class DispatcherKeepsRouting(McoreEngine):
    """NeMo-RL #2319: the all-to-all dispatcher keeps each step's routing tensors alive across the offload."""

    def replay_routing(self, *args, **kwargs):
        from megatron.core.transformer.moe.moe_layer import MoELayer

        out = super().replay_routing(*args, **kwargs)
        for model in self.models:
            for module in model.modules():
                if isinstance(module, MoELayer):
                    d = module.token_dispatcher
                    vars(d).setdefault("kept", []).append(d.routing_map.clone())
        return out


class SkipsMasterCopies(Offloading):
    def reload(self, store) -> None:
        masters = [m for m in store.moved if " parameter " in m.what]
        store.moved = [m for m in store.moved if m not in masters]
        super().reload(store)


class ReloadSkipsMasterCopies(McoreEngine):
    """NeMo-RL #2371: the reload brings back the model and Adam's moments but not the optimizer's fp32 master
    copies."""

    offload_part = SkipsMasterCopies


class LoadLeavesMastersStale(McoreEngine):
    """Megatron-LM #5071, Megatron-Bridge #4082: weights loaded without the optimizer state, and the fp32 master
    copies not refreshed from them: the first step overwrites the loaded weights with the initial ones' update."""

    def load_weights(self, seed: int) -> None:
        from harness.engines.model_config import _full_init

        for model in self.models:
            self.set_full(model.module, lambda name, shape: None if len(shape) < 2 else _full_init(name, shape, seed))


class ResendsFirstStream(McoreEngine):
    """A refit that packs its buckets once and sends the same packed buffers at every later refit without refilling
    them: each rollout after the first samples with the first iteration's policy."""

    def export_buckets(self, bucket_bytes: int):
        if not hasattr(self, "_packed"):
            self._packed = [[(name, t.detach().clone()) for name, t in bucket]
                            for bucket in super().export_buckets(bucket_bytes)]
        yield from self._packed


class KeepsWhatItSent(McoreEngine):
    """A sender that serializes each bucket for the rollout's socket and keeps the bytes it sent (a send queue or
    IPC handles never released): host memory grows by the stream at every refit, held in no tensor."""

    def export_buckets(self, bucket_bytes: int):
        import ctypes

        import torch

        sent = self.__dict__.setdefault("_sent", [])
        for bucket in super().export_buckets(bucket_bytes):
            for _, t in bucket:
                flat = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
                sent.append(ctypes.string_at(flat.data_ptr(), flat.numel()))
            yield bucket


class HostCopiesInBf16(Offloading):
    def reload(self, store) -> None:
        import torch

        super().reload(store)
        with torch.no_grad():
            for model in self.engine.models:
                for param in model.parameters():
                    param.copy_(param.to(torch.bfloat16).float())


class ReloadsThroughBf16(McoreEngine):
    """An offload that keeps the host copies of fp32 parameters in bf16 (half the host memory): the reload brings
    back every storage, resident and shaped, without the low bits of every weight."""

    offload_part = HostCopiesInBf16


class ExportsBeforeTheStep(McoreEngine):
    """A refit that takes its weights at the start of the iteration's training (before its optimizer steps), e.g.
    a stream prepared while the trainer still works: the rollout samples with the previous iteration's policy."""

    def replay_routing(self, batch, microbatches, recorded, mode, capture=False):
        if capture:  # the iteration's first mini-batch, before its step
            self._early = [[(n, t.detach().clone()) for n, t in bucket] for bucket in super().export_buckets(8 << 10)]
        return super().replay_routing(batch, microbatches, recorded, mode, capture)

    def export_buckets(self, bucket_bytes: int):
        early = getattr(self, "_early", None)
        if early is None:
            yield from super().export_buckets(bucket_bytes)
            return
        self._early = None
        yield from early


class ExportsAnExtraKey(McoreEngine):
    """A refit that sends one tensor the rollout's model has no key for (a renamed or leftover weight)."""

    def export_buckets(self, bucket_bytes: int):
        import torch

        yield from super().export_buckets(bucket_bytes)
        yield [("model.layers.0.mlp.leftover.weight", torch.zeros(4))]


class RefusesItsExport(McoreEngine):
    """An engine whose export says it cannot run for the case (as mbridge's on megatron's local layer spec)."""

    export_refusal = staticmethod(lambda model, backend: "planted: this export names Transformer Engine's layers only")


class TakesTheParamsWithTheOptimizer(Offloading):
    def optimizer(self, store) -> None:
        from harness.engines.offload import optimizer_tensors

        store.move(optimizer_tensors(self.engine.optimizer))


class OptimizerOffloadTakesTheParams(McoreEngine):
    """An optimizer offload that moves every tensor of the optimizer's parameter groups, as megatron's own
    `offload_to_cpu` walks them: in fp32 without the distributed optimizer those are the model's own parameters, so a
    colocated export after it reads freed storage."""

    offload_part = TakesTheParamsWithTheOptimizer


def _merge_owner():
    """The megatron-bridge class that merges one LoRA adapter into its base weight at export."""
    from megatron.bridge.models.conversion import peft_bridge

    return next(c for c in vars(peft_bridge).values()
                if isinstance(c, type) and "_merge_single_adapter_weight" in vars(c))


class MergesInBf16TermByTerm(MegatronBridgeEngine):
    """NeMo-RL #3696's shape: the merged refit computes W + (alpha / r) * B @ A in bf16 term by term (the product
    and the sum each rounded to bf16), not in fp32 cast once: the rollout loses part of the LoRA update."""

    def hf_weight_stream(self):
        import torch

        owner = _merge_owner()
        original = owner._merge_single_adapter_weight

        def in_bf16(_self, base_weight, alpha, dim, linear_in_weight, linear_out_weight):
            bf16 = torch.bfloat16
            lora = (alpha / dim) * (linear_out_weight.to(bf16) @ linear_in_weight.to(bf16))
            return (base_weight.to(bf16) + lora).to(base_weight.dtype)

        owner._merge_single_adapter_weight = in_bf16
        try:
            yield from super().hf_weight_stream()
        finally:
            owner._merge_single_adapter_weight = original


class MergesIntoTheBaseAtEveryRefit(MegatronBridgeEngine):
    """miles #1087's shape: each refit merges the adapters into the base weights in place and sends the base weights;
    the first refit after training is right, every later one adds the adapters again (pure DP: whole tensors)."""

    def hf_weight_stream(self):
        import torch

        scale = self.peft.alpha / self.peft.dim
        with torch.no_grad():
            for model in self.models:
                for module in model.module.modules():
                    wrapped, adapter = getattr(module, "to_wrap", None), getattr(module, "adapter", None)
                    if wrapped is not None and adapter is not None:
                        w = wrapped.weight
                        lora = adapter.linear_out.weight.float() @ adapter.linear_in.weight.float()
                        w.copy_((w.float() + scale * lora).to(w.dtype))
        if self._export_tasks is None:
            self._export_tasks = self.hf_conversion_tasks(self.ctx.workdir)
        for name, t in self.bridge.export_hf_weights(self.models, cpu=True, show_progress=False,
                                                     conversion_tasks=self._export_tasks, merge_adapter_weights=False):
            yield name.replace(".base_layer.", "."), t


class FoldsTheScalingIntoB(MegatronBridgeEngine):
    """SkyRL #2250's review: the adapter-only refit sends B with alpha / r folded in while adapter_config.json keeps
    lora_alpha, so the rollout's peft scales the update again."""

    def export_peft_adapter(self, path: str) -> str:
        from pathlib import Path

        import torch.distributed as dist
        from safetensors.torch import load_file, save_file

        who = super().export_peft_adapter(path)
        if dist.get_rank() == 0:
            f = Path(path) / "adapter_model.safetensors"
            scale = self.peft.alpha / self.peft.dim
            tensors = {k: (v * scale if "lora_B" in k else v).contiguous() for k, v in load_file(str(f)).items()}
            save_file(tensors, str(f))
        dist.barrier()
        return who
