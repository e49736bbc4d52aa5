"""An RL iteration's parts as RL frameworks run them through megatron (McoreEngine's; the rl-cycle suite).

The framework's part, each a method a user engine overrides to have its own code judged:
- `before_build`: megatron-core 0.16's `RouterReplay` keeps every router built in the process in one list; a
  framework that builds the model twice (a bridge, a reference-policy copy) clears it before building the policy;
- `record_routing` / `replay_routing`: the log-prob pass records each MoE layer's top-k experts per micro-batch
  (RouterReplayAction.RECORD), the training step replays them (REPLAY_FORWARD, the target set per micro-batch);
- `hold_expert_bias`: aux-loss-free balancing's expert bias kept where the router is frozen or routing is replayed
  (megatron-core 0.16.1 updates it regardless: `_update_router_expert_bias` checks neither; later releases skip a
  router whose `frozen_expert_bias` is set, which `after_build` sets with the router frozen, as megatron's own
  training loop does);
- the offload and reload are a part of their own the engine holds (harness/engines/offloading.py);
- `load_weights`: weights only, no optimizer state, then the optimizer's master copies refreshed from them
  (`reload_model_params`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from harness.engines.base import StepOutput, TokenLogprobs
from harness.engines.model_config import _full_init
from harness.upstream import frozen_expert_bias_honoured

if TYPE_CHECKING:
    import torch

    from harness.engines.rl_batch import RLBatch


@dataclass
class Routing:
    """Per MoE router of this rank (in model order), per micro-batch in schedule order: recorded top-k indices, or
    the routing a step used (its routing map as [tokens, top-k] expert indices), and how many tokens' fresh scores
    would have chosen other experts than the replayed ones."""

    layers: list[str]  # each router's global layer name
    indices: list[list[torch.Tensor]] = field(default_factory=list)
    fresh_differs: int = 0

    def part(self, start: int, stop: int | None) -> Routing:
        """The micro-batches start:stop of every router."""
        return Routing(self.layers, [per[start:stop] for per in self.indices])


class RLCycle:
    """Mixin of McoreEngine: the RL iteration's framework parts (the `RunsRLCycles` protocol)."""

    case: Any
    ctx: Any
    config: Any
    models: list
    optimizer: Any

    def before_build(self) -> None:
        """Before the chunks are built: RouterReplay's process-wide list emptied (a first build's routers - a
        bridge's, a reference policy's - are not the policy's)."""
        from megatron.core.transformer.moe.router_replay import RouterReplay

        RouterReplay.clear_global_router_replay_instances()

    def after_build(self, chunks: list) -> None:
        """The built chunks, before DDP wraps them: the routers frozen where the case says so, their expert bias
        marked frozen where megatron-core honours the mark (as megatron's training loop marks a frozen router)."""
        if self.case.options.freeze_router:
            mark = frozen_expert_bias_honoured()
            for router in routers(chunks):
                router.weight.requires_grad_(False)
                if mark:
                    router.frozen_expert_bias = True

    def bias_marked_frozen(self) -> bool:
        """Whether this rank's routers carry megatron's frozen_expert_bias mark (all of them; False without routers)."""
        live = routers([m.module for m in self.models])
        return bool(live) and all(vars(r).get("frozen_expert_bias") is True for r in live)

    # -- routing replay ---------------------------------------------------------------------------
    def record_routing(self, batch: RLBatch, microbatches: list[list[int]]) -> tuple[list[TokenLogprobs], Routing]:
        """The log-prob pass (forward only), each router's top-k recorded per micro-batch."""
        from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

        live = routers([m.module for m in self.models])
        rec = Routing(router_names(self.models), [[] for _ in live])

        def keep(i: int, router, inputs, output) -> None:
            if router.router_replay is not None and router.router_replay.recorded_topk_idx is not None:
                rec.indices[i].append(router.router_replay.recorded_topk_idx.detach().cpu().clone())

        replaying = self.case.options.routing_replay
        with _hooks(live, post=keep), _action(RouterReplay, RouterReplayAction.RECORD if replaying else None):
            logprobs = self.rl_logprobs(batch, microbatches)  # type: ignore[attr-defined]
        return logprobs, rec

    def replay_routing(self, batch: RLBatch, microbatches: list[list[int]], recorded: Routing | None,
                       mode: str, capture: bool = False) -> tuple[StepOutput, Routing]:
        """A training step on the micro-batches with the recorded routing replayed (None: routed afresh); what each
        router used, and how many tokens fresh scores would have routed elsewhere."""
        import torch
        from megatron.core.transformer.moe.router_replay import RouterReplay

        live = routers([m.module for m in self.models])
        used = Routing(router_names(self.models), [[] for _ in live])
        calls = [0] * len(live)

        def target(i: int, router, inputs) -> None:
            if recorded is not None and router.router_replay is not None:
                router.router_replay.set_target_indices(recorded.indices[i][calls[i]])
            calls[i] += 1

        def observe(i: int, router, inputs, output) -> None:
            routing_map = output[1].detach()
            k = router.topk
            chosen = routing_map.nonzero()[:, 1].reshape(-1, k)  # each token's experts, ascending
            used.indices[i].append(chosen.cpu().clone())
            with torch.no_grad():
                logits = router.gating(inputs[0].detach()).reshape(-1, routing_map.shape[-1]).float()
                scores = torch.sigmoid(logits) if router.score_function == "sigmoid" else logits
                if router.expert_bias is not None:
                    scores = scores + router.expert_bias
                fresh = scores.topk(k, dim=-1).indices.sort(dim=-1).values
            used.fresh_differs += int((fresh != chosen).any(dim=-1).sum())

        action = self.replay_action() if recorded is not None else None
        with self.hold_expert_bias(replayed=recorded is not None), _hooks(live, pre=target, post=observe), \
                _action(RouterReplay, action):
            out = self.train_rl_batch(batch, microbatches, mode, capture)  # type: ignore[attr-defined]
        RouterReplay.clear_global_indices()
        return out, used

    def replay_action(self) -> Any:
        """The RouterReplayAction a training step's forward runs under: the recorded top-k replayed."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        return RouterReplayAction.REPLAY_FORWARD

    @contextlib.contextmanager
    def hold_expert_bias(self, replayed: bool) -> Iterator[None]:
        """The expert bias held through a step whose router is frozen or whose routing is replayed (its token counts
        then say nothing of the router's balance): megatron's update rate 0 for the step."""
        hold = bool(self.config.moe_router_enable_expert_bias) and (replayed or self.case.options.freeze_router)
        rate = self.config.moe_router_bias_update_rate
        if hold:
            self.config.moe_router_bias_update_rate = 0.0
        try:
            yield
        finally:
            self.config.moe_router_bias_update_rate = rate

    def replay_instances(self) -> tuple[int, int, int]:
        """(entries of RouterReplay's process-wide list, this rank's live routers, those of them in the list)."""
        from megatron.core.transformer.moe.router_replay import RouterReplay

        listed = RouterReplay.global_router_replay_instances
        live = [r.router_replay for r in routers([m.module for m in self.models]) if r.router_replay is not None]
        return len(listed), len(live), sum(1 for r in live if any(r is x for x in listed))

    # -- weights-only load -------------------------------------------------------------------------
    def load_weights(self, seed: int) -> None:
        """Weights only (as a framework loads a policy's weights, no optimizer state): every weight matrix set to
        the initial values of `seed`, then the optimizer's master copies refreshed from the parameters."""

        for model in self.models:
            self.set_full(model.module, lambda name, shape: None if len(shape) < 2  # type: ignore[attr-defined]
                          else _full_init(name, shape, seed))
        self.optimizer.reload_model_params()


def routers(chunks: list) -> list:
    """The MoE routers of the unwrapped chunks, in model order."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, TopKRouter)]


def router_names(models: list) -> list[str]:
    """Each router's global layer name (decoder.layers.<global>.mlp.router), in model order."""
    from megatron.core.transformer.moe.router import TopKRouter

    out = []
    for model in models:
        chunk = model.module
        for name, m in chunk.named_modules():
            if isinstance(m, TopKRouter):
                local = int(name.split(".")[2])
                out.append(f"decoder.layers.{chunk.decoder.layers[local].layer_number - 1}.mlp.router")
    return out


@contextlib.contextmanager
def _hooks(live: list, pre=None, post=None) -> Iterator[None]:
    import functools

    handles = []
    for i, router in enumerate(live):
        if pre is not None:
            handles.append(router.register_forward_pre_hook(functools.partial(pre, i)))
        if post is not None:
            handles.append(router.register_forward_hook(functools.partial(post, i)))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def _action(replay: Any, action: Any) -> Iterator[None]:
    if action is not None:
        replay.set_global_router_replay_action(action)
    try:
        yield
    finally:
        replay.clear_global_router_replay_action()
