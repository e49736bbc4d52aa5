"""Engines with planted regressions, given to suites by import path (--engine tests.plants.faulty_engines:...)."""

from __future__ import annotations

from harness.engines.fsdp2 import FSDP2Engine
from harness.engines.mcore import McoreEngine
from harness.power import PlantedSlowdown


class _DoneHandle:
    def wait(self):
        pass

    def is_completed(self):
        return True


class SkipOneTpGradReduce(McoreEngine):
    """Skips the first TP all-reduce of an input gradient (column-parallel dgrad) in the whole run."""

    def build(self) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import layers

        original = dist.all_reduce
        skipped = []

        def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            tp_group = ps.get_tensor_model_parallel_group()
            if not skipped and group is tp_group and dist.get_world_size(group) > 1:
                skipped.append(True)
                return _DoneHandle() if async_op else None
            return original(tensor, op=op, group=group, async_op=async_op)

        # megatron's linear layers call torch.distributed.all_reduce through the module attribute
        layers.torch.distributed.all_reduce = all_reduce
        super().build()


class DistDdpPlainOptimizer(McoreEngine):
    """DDP built with the distributed optimizer (reduce-scatter) whatever the user configured, paired
    with the optimizer the user configured: R2's outcome when use_distributed_optimizer=False."""

    def ddp_config(self):
        cfg = super().ddp_config()
        cfg.use_distributed_optimizer = True
        return cfg

    def build(self) -> None:
        self.setup_parallel()
        chunks = self.build_chunks()
        self.models = self.wrap(chunks, self.ddp_config())
        self.optimizer = self.make_optimizer(self.models, self.case.options.use_distributed_optimizer)
        self._wire_config()


class SkipParamAllGather(McoreEngine):
    """The distributed optimizer never all-gathers updated parameters: each rank keeps stale shards."""

    def build(self) -> None:
        from megatron.core.distributed import param_and_grad_buffer as pgb

        pgb._ParamAndGradBucketGroup.start_param_sync = lambda self, force_sync=False: None
        super().build()


_KEPT_GROUPS: list = []


class NormsKeptInFp32(McoreEngine):
    """Builds a bf16 model whose norms stay fp32, as megatron's local spec makes them without Float16Module's cast:
    their gradients take a DDP buffer of their own."""

    def reinit(self, chunk) -> None:
        import torch

        super().reinit(chunk)
        for module in chunk.modules():
            if isinstance(module, (torch.nn.RMSNorm, torch.nn.LayerNorm)):
                module.float()


class KeepsGroupAlive(McoreEngine):
    """Keeps a reference to its DP process group after the case (as an lru_cache on a method did): the group
    is destroyed but its gloo threads run on in the warm rank."""

    def build(self) -> None:
        from megatron.core import parallel_state

        super().build()
        _KEPT_GROUPS.append(parallel_state.get_data_parallel_group())


class GradReduceOnWorld(McoreEngine):
    """Gradients reduced over the whole world instead of the DP x CP group (sums different TP shards)."""

    def build(self) -> None:
        import torch.distributed as dist

        super().build()
        for model in self.models:
            for group in model.bucket_groups + model.expert_parallel_bucket_groups:
                group.data_parallel_group = dist.group.WORLD


class FullyReshardableDefault(McoreEngine):
    """R1: the default checkpoint format flips to fully_reshardable (every DP rank gathers 12N bytes)."""

    default_ckpt_format = "fully_reshardable"


class ExtraStateCopyOnSave(McoreEngine):
    """Holds an extra host copy of 10% of the shard's optimizer state (12N bytes) during the save."""

    def save_checkpoint(self, ckpt_dir, fmt, fully_parallel=False):
        import torch

        n = sum(p.numel() for m in self.models for p in m.module.parameters())
        extra = torch.ones(int(0.10 * 12 * n) // 4, dtype=torch.float32)  # 10% of 12N bytes
        try:
            return super().save_checkpoint(ckpt_dir, fmt, fully_parallel)
        finally:
            del extra


class KeepsAHostCopyOfEverySave(McoreEngine):
    """Every save leaves a host copy of 10% of the shard's optimizer state (12N bytes) referenced after it returns:
    a staging cache keyed by call instead of by shape (verl #5665, pytorch #170163's shape). One save's peak is
    unchanged by it; the memory is still there at the next save."""

    def save_checkpoint(self, ckpt_dir, fmt, fully_parallel=False, async_save=False):
        import torch

        n = sum(p.numel() for m in self.models for p in m.module.parameters())
        self.__dict__.setdefault("staging", []).append(torch.ones(int(0.10 * 12 * n) // 4, dtype=torch.float32))
        return super().save_checkpoint(ckpt_dir, fmt, fully_parallel, async_save)


def _mbridge_engine():
    from harness.engines.mbridge import MbridgeEngine

    return MbridgeEngine


class MbridgeOverrideOnly(_mbridge_engine()):
    """R2 itself: the vanilla-bridge route passes only the override dict as ddp_config, so mbridge's
    own default (use_distributed_optimizer=True) wins over the user's wrap config."""

    overrides = {"overlap_grad_reduce": False}

    def bridge_ddp_config(self):
        return dict(self.overrides)


class MbridgeWithoutTrainingOptions(_mbridge_engine()):
    """What the bridge paths were: the model built without the case's training fields (the loss mask's per-token
    normalisation, recompute) and the optimizer stepped without its learning-rate schedule."""

    def config_overrides(self):
        extra = super().config_overrides()
        extra.pop("calculate_per_token_loss", None)
        return extra

    def after_optimizer(self):
        self._wire_config()


class NaNParamAfterLastStep(McoreEngine):
    """Writes NaN into one element of one parameter after the last training step, on every layout but
    pure DP (the equivalence reference): a NaN error must fail, not compare as within tolerance."""

    def train_step(self, step: int):
        import torch

        out = super().train_step(step)
        lay = self.case.layout
        if step == self.case.options.steps - 1 and (lay.tp, lay.pp, lay.cp) != (1, 1, 1):
            with torch.no_grad():
                p = next(iter(self.models[0].module.parameters()))
                p.view(-1)[0] = float("nan")
        return out


class _PatchedDuringSteps(McoreEngine):
    """Replaces a module attribute of megatron for the duration of each training step (restored after,
    so a warm rank keeps nothing of it)."""

    target: tuple[str, str] = ("", "")

    def replacement(self, original):
        raise NotImplementedError

    def train_step(self, step: int):
        import importlib

        module = importlib.import_module(self.target[0])
        original = getattr(module, self.target[1])
        setattr(module, self.target[1], self.replacement(original))
        try:
            return super().train_step(step)
        finally:
            setattr(module, self.target[1], original)


class WrongZigzagChunks(_PatchedDuringSteps):
    """megatron's get_batch_on_this_cp_rank gives CP rank r chunks r and r + cp (the halves paired in
    order) instead of r and 2cp-1-r: every token still lands on exactly one rank, in the wrong place."""

    target = ("megatron.core.utils", "get_batch_on_this_cp_rank")

    def replacement(self, original):
        import torch
        from megatron.core import parallel_state as ps

        def split(batch, cp_group=None):
            cp, r = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
            out = {}
            for key, val in batch.items():
                chunks = val.view(val.shape[0], 2 * cp, val.shape[1] // (2 * cp), *val.shape[2:])
                out[key] = chunks.index_select(1, torch.tensor([r, r + cp])).reshape(val.shape[0], -1, *val.shape[2:])
            return out

        return split


class ContiguousRopeSlice(_PatchedDuringSteps):
    """The rotary embedding's CP slice taken as one contiguous block per rank instead of megatron's
    zigzag chunks r and 2cp-1-r: tokens are rotated for the wrong positions."""

    target = ("megatron.core.models.common.embeddings.rotary_pos_embedding", "get_pos_emb_on_this_cp_rank")

    def replacement(self, original):
        def contiguous(pos_emb, seq_dim, cp_group):
            return pos_emb.chunk(cp_group.size(), dim=seq_dim)[cp_group.rank()]

        return contiguous


# Planted step times that no machine load can hide or fake: every timed step waits BEYOND x the median step of the
# baseline the case is judged against, times the factor by which that baseline's own repeats differ, and at least
# its longest step. A busy wait lasts its wall time however loaded the machine is, so every timed step is longer
# than every baseline step (the test over block means is as significant as its sample sizes allow) and the ratio
# of medians lies beyond the minimum effect and the repeats' drift (within which step-perf cannot tell). What
# load can add to a step's own work stays far below the wait: a 2-core machine running another world-size-4 run
# beside the test slowed tiny's steps about x3.
BEYOND = 8


def beyond_the_baseline_s(case) -> float:
    """The planted wait of a step-perf case (seconds; 0.0 where its baseline has no entry for the case)."""
    import json
    import statistics

    from harness import baselines
    from harness.platform import detect_platform
    from harness.suite_defs.step_perf.figures import key

    path = baselines.suite_path(case.params.baselines_dir, detect_platform(case.backend).key, "step-perf")
    entry = json.loads(path.read_text())["entries"].get(key(case)) if path.exists() else None
    if not entry:
        return 0.0
    times = entry["step_time_ms"]
    drift = max(times["values"]) / min(times["values"])
    return max(BEYOND * drift * statistics.median(times["samples"]), max(times["samples"])) / 1000


class Straggler(McoreEngine):
    """Rank 1 is slow in backward after the case's warm-up steps: it busy-waits beyond_the_baseline_s() per
    training step (spread over its micro-batches), and the others wait for it at the gradient sync. Busy, not
    asleep: with 4 ranks on 2 cores a sleeping rank hands its core to the others."""

    def __init__(self, case, ctx):
        super().__init__(case, ctx)
        self._sleep_s = 0.0

    def forward_step(self, data_iterator, model):
        output, loss_func = super().forward_step(data_iterator, model)
        if self._sleep_s and output.requires_grad:
            output.register_hook(self._straggle)  # runs inside backward
        return output, loss_func

    def _straggle(self, grad):
        import time

        end = time.perf_counter() + self._sleep_s
        while time.perf_counter() < end:
            pass
        return grad

    def train_step(self, step: int):
        if self.ctx.rank == 1 and step >= self.case.options.warmup_steps and not self._sleep_s:
            self._sleep_s = beyond_the_baseline_s(self.case) / self.case.num_microbatches
        return super().train_step(step)


class NeedsMissingModule(McoreEngine):
    """An engine whose framework imports a package the ranks' environment lacks (as a user's RL framework that
    imports `ray` would): every case errors in build with the same ModuleNotFoundError."""

    def build(self) -> None:
        import harness_missing_framework  # noqa: F401  (not installed anywhere)

        super().build()


class ExpertGradsOverDenseDP(McoreEngine):
    """Expert gradients reduced over the dense data-parallel group instead of the expert-data-parallel group
    (Megatron-LM #5916's shape): the experts are left unmarked (`allreduce=True`), so megatron's DDP puts them in
    the dense buffers - at EP > 1 those sum the gradients of other ranks' experts into this rank's."""

    def build_chunks(self, params_dtype: str | None = None) -> list:
        chunks = super().build_chunks(params_dtype)
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                if ".mlp.experts." in name:
                    p.allreduce = True
        return chunks


class AuxLossScaledByEP(_PatchedDuringSteps):
    """The load-balancing auxiliary loss multiplied by the EP size (a normalisation that counted the EP ranks'
    tokens twice): its value and its gradient grow on EP layouts only."""

    target = ("megatron.core.transformer.moe.router", "switch_load_balancing_loss_func")

    def replacement(self, original):
        def scaled(*args, **kwargs):
            from megatron.core import parallel_state as ps

            return original(*args, **kwargs) * ps.get_expert_model_parallel_world_size()

        return scaled


class ExpertTokensOutOfOrder(McoreEngine):
    """The all-to-all dispatcher hands the first local expert its tokens in reverse order when EP > 1 (a wrong
    permutation after the all-to-all): that expert's outputs return to the wrong tokens."""

    def train_step(self, step: int):
        from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as Dispatcher

        original = Dispatcher.dispatch_postprocess

        def reversed_first_expert(dispatcher, hidden_states, probs):
            import torch

            tokens, per_expert, probs = original(dispatcher, hidden_states, probs)
            if dispatcher.ep_size > 1:
                n = int(per_expert[0])
                tokens = torch.cat([tokens[:n].flip(0), tokens[n:]])
            return tokens, per_expert, probs

        Dispatcher.dispatch_postprocess = reversed_first_expert
        try:
            return super().train_step(step)
        finally:
            Dispatcher.dispatch_postprocess = original


class TokenAllToAllTwice(_PatchedDuringSteps):
    """The token dispatcher issues every all-to-all twice and drops the first result (a redundant exchange, as a
    refactor that recomputes a permutation's input leaves): results unchanged, the EP traffic doubled."""

    target = ("megatron.core.transformer.moe.token_dispatcher", "all_to_all")

    def replacement(self, original):
        def twice(*args, **kwargs):
            original(*args, **kwargs)
            return original(*args, **kwargs)

        return twice


class GradNormMissesOtherEPExperts(McoreEngine):
    """The gradient norm leaves out the experts other EP ranks hold (Megatron-LM PR #5916's shape): the expert
    optimizer's gradient statistics are reduced over the expert TP group only, not over EP (and PP), so clipping
    is too weak and the reported norm depends on the layout."""

    def make_optimizer(self, models: list, use_distributed_optimizer: bool):
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        optimizer = super().make_optimizer(models, use_distributed_optimizer)
        # the expert optimizer's group: the expert TP x EP x PP ranks (megatron-core 0.19 builds its own group object
        # of them, so it is told by its ranks; the dense optimizer's spans TP x PP)
        expert = dist.get_process_group_ranks(ps.get_expert_tensor_model_pipeline_parallel_group())
        for inner in getattr(optimizer, "chained_optimizers", [optimizer])[1:]:
            group = getattr(inner, "grad_stats_parallel_group", None)
            if group is not None and dist.get_process_group_ranks(group) == expert:
                inner.grad_stats_parallel_group = ps.get_expert_tensor_parallel_group()
        return optimizer


class OverlapLost(McoreEngine):
    """DDP built with overlap_grad_reduce=False whatever the case asks: no gradient reduction overlaps
    with backward."""

    def ddp_config(self):
        cfg = super().ddp_config()
        cfg.overlap_grad_reduce = False
        return cfg


class SmallBuckets(McoreEngine):
    """DDP gradient buckets 8x smaller than the case configures (or megatron's default, max(40M, 1M x dp))."""

    def ddp_config(self):
        from megatron.core import parallel_state as ps

        cfg = super().ddp_config()
        default = max(40_000_000, 1_000_000 * ps.get_data_parallel_world_size(with_context_parallel=True))
        cfg.bucket_size = (self.case.options.bucket_size or default) // 8
        return cfg


class RecomputeOn(McoreEngine):
    """Full activation recompute switched on whatever the case asks (every layer's forward runs twice)."""

    def __init__(self, case, ctx):
        import dataclasses

        super().__init__(dataclasses.replace(case, options=dataclasses.replace(case.options, recompute="full")), ctx)


class KeepsWeightCopy(McoreEngine):
    """Keeps an fp32 copy of every parameter after the build (a leftover of a conversion, say): +4N bytes."""

    def build(self) -> None:
        super().build()
        self._copy = [p.detach().float().clone() for m in self.models for p in m.parameters()]


class RecomputeIgnored(McoreEngine):
    """The case asks for activation recompute; the engine builds the model without it."""

    def __init__(self, case, ctx):
        import dataclasses

        super().__init__(dataclasses.replace(case, options=dataclasses.replace(case.options, recompute="")), ctx)
        self.case_as_asked = case


class CostlyInstrumentation(McoreEngine):
    """The harness's instrumentation, not the engine, is slow: while step-perf's timer has megatron's seams
    wrapped, each step busy-waits COST x the longest of the last uninstrumented steps (as a probe that
    synchronised or copied inside the step would cost). The last ones, not all: under a load that grows during
    the run the early steps are short, and a wait sized by them vanished in the noise (x0.89 measured with the
    machine running two other test workers' ranks)."""

    COST = 1.0

    def __init__(self, case, ctx):
        from megatron.core.pipeline_parallel import schedules

        super().__init__(case, ctx)
        self._plain_forward = schedules.forward_step
        self._plain_s: list[float] = []

    def train_step(self, step: int):
        import time

        from megatron.core.pipeline_parallel import schedules

        instrumented = schedules.forward_step is not self._plain_forward
        t0 = time.perf_counter()
        out = super().train_step(step)
        if not instrumented:
            self._plain_s.append(time.perf_counter() - t0)
        elif self._plain_s:
            end = time.perf_counter() + self.COST * max(self._plain_s[-3:])
            while time.perf_counter() < end:
                pass
        return out


# -- numerics that move every layout alike (equivalence cannot see them; golden must) ----------------------

class AdamBeta1Changed(McoreEngine):
    """Adam's beta1 default changed from megatron's 0.9 to 0.8."""

    def optimizer_config(self, use_distributed_optimizer: bool):
        config = super().optimizer_config(use_distributed_optimizer)
        config.adam_beta1 = 0.8
        return config


class ClippingOff(McoreEngine):
    """Gradient clipping switched off (clip_grad 0)."""

    def optimizer_config(self, use_distributed_optimizer: bool):
        config = super().optimizer_config(use_distributed_optimizer)
        config.clip_grad = 0.0
        return config


class InitStdChanged(McoreEngine):
    """Weights initialised with std 0.021 instead of 0.02 (every layout alike: by global name)."""

    def reinit(self, chunk) -> None:
        super().reinit(chunk)
        import torch

        with torch.no_grad():
            for p in chunk.parameters():
                if p.dim() >= 2:
                    p.mul_(1.05)


class LayerNormEpsChanged(McoreEngine):
    """The norms' epsilon changed from megatron's 1e-5 to 1e-6 (as a config default that moved would)."""

    def build_chunks(self, params_dtype: str | None = None) -> list:
        from harness.engines import mcore

        original = mcore.transformer_config

        def changed(case, on_cpu, params_dtype=None):
            config = original(case, on_cpu, params_dtype)
            self.change(config)
            return config

        mcore.transformer_config = changed
        try:
            return super().build_chunks(params_dtype)
        finally:
            mcore.transformer_config = original

    @staticmethod
    def change(config) -> None:
        config.layernorm_epsilon = 1e-6


class LossPerMicrobatch(LayerNormEpsChanged):
    """The loss normalised per micro-batch (each micro-batch's mean, averaged) instead of per token, as when
    calculate_per_token_loss is lost: with masked tokens, samples that count fewer tokens weigh more."""

    @staticmethod
    def change(config) -> None:
        config.calculate_per_token_loss = False


class OptimizerStateNotRestored(McoreEngine):
    """A load that restores the model's weights but not the optimizer's state (Adam starts over)."""

    def load_checkpoint(self, ckpt_dir: str, fmt: str) -> None:
        from megatron.core import dist_checkpointing

        state = dist_checkpointing.load({"model": self.models[0].module.sharded_state_dict()}, ckpt_dir)
        self.models[0].module.load_state_dict(state["model"])
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            opt.reload_model_params()  # the main copies from the loaded weights, as a model-only load does
        if self.scheduler is not None:  # the learning-rate schedule is restored: the one fault is Adam's state
            self.scheduler.load_state_dict(state["opt_param_scheduler"])


class StepCounterReset(McoreEngine):
    """A load that restores Adam's moments but resets its step counter (bias correction restarts)."""

    def load_checkpoint(self, ckpt_dir: str, fmt: str) -> None:
        super().load_checkpoint(ckpt_dir, fmt)
        import torch

        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            for st in opt.optimizer.state.values():
                if "step" in st:
                    st["step"] = torch.zeros_like(st["step"]) if isinstance(st["step"], torch.Tensor) else 0


class ScheduleNotRestored(McoreEngine):
    """A load that restores the model and the optimizer but not the learning-rate schedule, which starts its warm-up
    over (verl #7953: megatron's OptimizerParamScheduler state is saved, but loaded only where
    use_checkpoint_opt_param_scheduler is set, and it is off by default)."""

    def load_checkpoint(self, ckpt_dir: str, fmt: str) -> None:
        scheduler, self.scheduler = self.scheduler, None
        try:
            super().load_checkpoint(ckpt_dir, fmt)
        finally:
            self.scheduler = scheduler


class FSDP2OptimizerStateNotRestored(FSDP2Engine):
    """fsdp2: a sharded load that restores the model's weights but not torch Adam's state (it starts over)."""

    def load_checkpoint(self, ckpt_dir: str, fmt: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

        state = {"model": get_model_state_dict(self.model)}
        if self.scheduler is not None:  # the learning-rate schedule is restored: the one fault is Adam's state
            state["opt_param_scheduler"] = self.scheduler.state_dict()
        dcp.load(state, checkpoint_id=ckpt_dir)
        set_model_state_dict(self.model, state["model"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["opt_param_scheduler"])


class SerialisedReduction(PlantedSlowdown):
    """Every rank waits in the gradient sync (finalize_model_grads: the DP reduction not overlapped) after the
    warm-up, beyond_the_baseline_s() per step: exposed communication grows by far more than half the step's
    growth."""

    WHERE = "comm"

    def __init__(self, case, ctx):
        super().__init__(case, ctx)
        self._beyond: float | None = None

    def wait_s(self) -> float:
        if self._beyond is None:
            self._beyond = beyond_the_baseline_s(self.case)
        return self._beyond



class StepsOverSkipThreshold(McoreEngine):
    """megatron-core 0.19's OptimizerConfig.grad_norm_skip_threshold set below every step's gradient norm: megatron
    skips each update and training goes on as if it had trained."""

    def optimizer_config(self, use_distributed_optimizer: bool):
        from harness.upstream import skip_threshold_field

        config = super().optimizer_config(use_distributed_optimizer)
        name = skip_threshold_field()
        if name is None:
            raise RuntimeError("this megatron-core has no grad_norm_skip_threshold (0.19 and later)")
        setattr(config, name, 1e-12)
        return config


class NonFiniteGradientAtStep1(McoreEngine):
    """A NaN in one parameter's gradient at step 1 (an overflow, a bad sample): megatron's optimizer finds the
    non-finite norm and skips the update, on every release."""

    def train_step(self, step: int):
        if step != 1:
            return super().train_step(step)
        param = next(p for m in self.models for p in m.module.parameters() if p.requires_grad)
        handle = param.register_hook(lambda grad: grad * float("nan"))
        try:
            return super().train_step(step)
        finally:
            handle.remove()
