"""An MoE model's expert parameters in a rank: told apart by name, and the groups they are sharded and reduced over
(the expert grid of megatron's parallel state: ETP for their shards, EDP for their gradients and optimizer state)."""

from __future__ import annotations

import re
from typing import Any

EXPERT_RE = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


def is_expert(name: str) -> bool:
    """Whether a parameter (by its name, local or global) is a routed expert's weight."""
    return bool(EXPERT_RE.search(name))


def tp_coords(name: str) -> tuple[int, int]:
    """(rank, size) of the tensor-parallel group a parameter (by its name) is sharded over: the expert TP group
    for an expert's weights, else the TP group. (megatron's `allreduce=False` mark of expert weights is set only
    with EP > 1.)"""
    from megatron.core import parallel_state as ps

    if is_expert(name):
        return ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


def data_parallel(param: Any) -> tuple[Any, int]:
    """(group, this rank's index in it) over which megatron reduces a parameter's gradient and shards its
    distributed-optimizer state: the expert data-parallel group for the experts it marks (EP > 1), else DP x CP."""
    from megatron.core import parallel_state as ps

    if not getattr(param, "allreduce", True):
        return ps.get_expert_data_parallel_group(), ps.get_expert_data_parallel_rank()
    return (ps.get_data_parallel_group(with_context_parallel=True),
            ps.get_data_parallel_rank(with_context_parallel=True))


def drop_routing_graphs(models: list) -> None:
    """Drop what megatron's MoE token dispatchers keep of the batch just run that carries an autograd graph
    (0.16: the routing probabilities, `probs`). That graph's gradient-accumulator nodes hold DDP's hooks and DDP
    holds the model: a cycle through autograd's C++ nodes, which Python's collector cannot see, so a finished MoE
    case's model - and its process groups' gloo threads - outlived the case in a warm rank. The next forward
    sets them again."""
    import torch
    from megatron.core.transformer.moe.moe_layer import MoELayer

    for model in models:
        for module in model.modules():
            if isinstance(module, MoELayer):
                dispatcher = module.token_dispatcher
                for name, value in list(vars(dispatcher).items()):
                    if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                        setattr(dispatcher, name, None)
