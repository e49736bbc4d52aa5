"""Record every collective a rank issues, at two levels that must agree.

- dispatcher: a TorchDispatchMode that sees every `c10d::*` op (coalesced ones included), whoever
  called it and however torch.distributed was aliased at import time;
- megatron's aliases: wrappers around the module-level functions megatron's gradient buffer calls
  (`dist_reduce_scatter_func`, `dist_all_gather_func`, `torch.distributed.all_reduce`).

Each record names the op, the group (ranks and megatron role), dtype, elements, bytes and the phase
(forward / backward from autograd's current node, otherwise the phase the caller set).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from harness.platform.cpu_collectives import unpadded_numel

# c10d op name -> collective kind
_KINDS = {
    "allreduce": "all_reduce", "reduce_scatter": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter",
    "allgather": "all_gather", "_allgather_base": "all_gather", "broadcast": "broadcast", "send": "send",
    "recv": "recv", "barrier": "barrier", "gather": "gather", "scatter": "scatter", "alltoall": "all_to_all",
    "reduce": "reduce",
}


def kind_of(op: str) -> str:
    """c10d op name (allreduce_coalesced_, reduce_scatter_tensor_coalesced_, ...) -> collective kind."""
    name = op.replace("_", "")
    for prefix in sorted(_KINDS, key=lambda k: len(k.replace("_", "")), reverse=True):
        if name.startswith(prefix.replace("_", "")):
            return _KINDS[prefix]
    return op.strip("_")


@dataclass(frozen=True)
class Collective:
    op: str  # e.g. reduce_scatter_tensor_coalesced_ (dispatcher) or reduce_scatter_tensor (alias)
    kind: str  # all_reduce | reduce_scatter | all_gather | broadcast | send | recv | ...
    ranks: tuple[int, ...]  # global ranks of the group
    role: str  # megatron role of the group: dp-cp, dp, tp, pp, cp, embedding, world, ...
    dtype: str
    numel: int  # elements of the full (unsharded) data the collective moves; an all-to-all's: what the rank sends
    bytes: int
    tensors: int  # tensors in the call (buckets of a coalesced call)
    phase: str
    source: str  # dispatch | alias

    def describe(self) -> str:
        return (f"{self.op} on {self.role} group {self.ranks}, {self.numel} x {self.dtype}"
                f" in {self.phase}")


def _tensor_groups(args: Any) -> list[list[torch.Tensor]]:
    """Tensor arguments, each positional argument a group (lists flattened)."""
    groups = []
    for a in args:
        if isinstance(a, torch.Tensor):
            groups.append([a])
        elif isinstance(a, (list, tuple)):
            flat = []
            for x in a:
                if isinstance(x, torch.Tensor):
                    flat.append(x)
                elif isinstance(x, (list, tuple)):
                    flat += [y for y in x if isinstance(y, torch.Tensor)]
            if flat:
                groups.append(flat)
    return groups


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
            torch.int64: "int64", torch.int32: "int32"}.get(dtype, str(dtype).replace("torch.", ""))


class GroupRoles:
    """Names megatron's process groups by role, from parallel_state (call after it is initialised)."""

    # When two roles share a group object (e.g. dp and dp-cp at CP=1) the first listed wins.
    ORDER = ("dp-cp", "dp", "edp", "tp", "pp", "cp", "ep", "etp", "etp-ep", "etp-ep-pp", "embedding",
             "position-embedding", "tp-cp", "mp", "tp-dp-cp", "tp-dp", "distopt-instance", "dp-cp-gloo", "dp-gloo",
             "edp-gloo")

    def __init__(self) -> None:
        self.by_name: dict[str, str] = {}
        try:
            from megatron.core import parallel_state as ps
        except ImportError:
            ps = None
        getters = {}
        if ps is not None and ps.model_parallel_is_initialized():
            getters = {
                "dp-cp": lambda: ps.get_data_parallel_group(with_context_parallel=True),
                "dp": lambda: ps.get_data_parallel_group(),
                "tp": ps.get_tensor_model_parallel_group, "pp": ps.get_pipeline_model_parallel_group,
                "cp": ps.get_context_parallel_group, "embedding": ps.get_embedding_group,
                "position-embedding": ps.get_position_embedding_group,
                "tp-cp": ps.get_tensor_and_context_parallel_group, "mp": ps.get_model_parallel_group,
                "tp-dp-cp": lambda: ps.get_tensor_and_data_parallel_group(with_context_parallel=True),
                "tp-dp": lambda: ps.get_tensor_and_data_parallel_group(),
                "dp-cp-gloo": lambda: ps.get_data_parallel_group_gloo(with_context_parallel=True),
                "dp-gloo": lambda: ps.get_data_parallel_group_gloo(),
                "distopt-instance": ps.get_intra_distributed_optimizer_instance_group,
                # the expert grid of an MoE model (megatron's expert rank generator: etp x ep x edp per stage)
                "edp": lambda: ps.get_expert_data_parallel_group(), "ep": ps.get_expert_model_parallel_group,
                "etp": ps.get_expert_tensor_parallel_group, "etp-ep": ps.get_expert_tensor_and_model_parallel_group,
                "etp-ep-pp": ps.get_expert_tensor_model_pipeline_parallel_group,
                "edp-gloo": lambda: ps.get_expert_data_parallel_group_gloo(),
            }
        for role in reversed(self.ORDER):
            if role not in getters:
                continue
            try:
                group = getters[role]()
            except (AssertionError, AttributeError, RuntimeError):
                continue
            for g in group if isinstance(group, list) else [group]:
                if g is not None:
                    self.by_name[g.group_name] = role
        world = dist.group.WORLD if dist.is_initialized() else None
        self.by_name.setdefault(world.group_name if world is not None else "", "world")

    def add(self, groups: list[dist.ProcessGroup], role: str) -> GroupRoles:
        """Name more groups by a role, where parallel_state names them nothing else (e.g. the groups an optimizer
        reduces its gradient norm over: megatron-core 0.19 builds the expert optimizer's from its own collection)."""
        for g in groups:
            if g is not None and g.group_name not in self.by_name:
                self.by_name[g.group_name] = role
        return self

    def role(self, group: dist.ProcessGroup) -> str:
        return self.by_name.get(group.group_name, "world" if group is dist.group.WORLD else "other")


def grad_stats_groups(optimizer: Any) -> list[dist.ProcessGroup]:
    """The groups a megatron optimizer (each of a chained one's) reduces its gradient norm and zero count over."""
    from megatron.core.optimizer import ChainedOptimizer, MegatronOptimizer

    parts = optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]
    return [o.get_grad_stats_parallel_group() for o in parts if isinstance(o, MegatronOptimizer)]


@dataclass
class CollectiveRecorder:
    """Records collectives while active; `phase(name)` labels what is issued inside it."""

    roles: GroupRoles = field(default_factory=GroupRoles)
    records: list[Collective] = field(default_factory=list)
    current_phase: str = "other"
    _stack: contextlib.ExitStack | None = None

    # -- phases -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def phase(self, name: str):
        saved, self.current_phase = self.current_phase, name
        try:
            yield
        finally:
            self.current_phase = saved

    def _phase_now(self) -> str:
        if self.current_phase == "forward-backward":
            return "backward" if torch._C._current_autograd_node() is not None else "forward"
        return self.current_phase

    # -- recording ----------------------------------------------------------------------------
    def _record(self, op: str, group, tensor_groups: list[list[torch.Tensor]], source: str) -> None:
        if group is None:
            group = dist.group.WORLD
        try:
            ranks = tuple(dist.get_process_group_ranks(group))
        except (RuntimeError, ValueError):
            ranks = ()
        sizes = [(sum(t.numel() for t in g), g) for g in tensor_groups]
        if kind_of(op) == "all_to_all" and len(sizes) >= 2:
            # (output, input): what the rank sends - summed over the group, what all of it moves, however the
            # routing splits it (the larger side would depend on the split)
            numel, main = sizes[1]
        else:
            numel, main = max(sizes, key=lambda s: s[0]) if sizes else (0, [])
        nbytes = sum(t.numel() * t.element_size() for t in main)
        unpadded = unpadded_numel()  # the CPU layer's padded stand-in for an uneven all-gather: its true size
        if unpadded is not None and main:
            numel, nbytes = unpadded, unpadded * main[0].element_size()
        dtype = main[0].dtype if main else torch.float32
        self.records.append(Collective(
            op=op, kind=kind_of(op), ranks=ranks, role=self.roles.role(group), dtype=_dtype_name(dtype),
            numel=numel, bytes=nbytes, tensors=len(main),
            phase=self._phase_now(), source=source,
        ))

    def __enter__(self) -> CollectiveRecorder:
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(_DispatchRecorder(self))
        self._stack.enter_context(_alias_recorder(self))
        return self

    def __exit__(self, *exc) -> None:
        assert self._stack is not None
        self._stack.close()
        self._stack = None

    def by_source(self, source: str) -> list[Collective]:
        return [r for r in self.records if r.source == source]


class _DispatchRecorder(TorchDispatchMode):
    def __init__(self, recorder: CollectiveRecorder):
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            group = None
            for a in args:
                if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type()):
                    group = dist.ProcessGroup.unbox(a)
                    break
            self.recorder._record(_op_name(func), group, _tensor_groups(args), "dispatch")
        elif func.namespace in FUNCTIONAL_NAMESPACES and kind_of(_op_name(func)) in _KINDS.values():
            # (not their bookkeeping ops: wait_tensor, _wrap_tensor_autograd)
            # torch's functional collectives (DTensor, FSDP2): the group is named by a string argument
            group = _functional_group(args, kwargs or {})
            self.recorder._record(_op_name(func), group, _tensor_groups(args), "dispatch")
        return func(*args, **(kwargs or {}))


# the ops of torch.distributed._functional_collectives (the legacy namespace without the underscore too)
FUNCTIONAL_NAMESPACES = ("_c10d_functional", "c10d_functional")


def _op_name(func) -> str:
    return func._opname if isinstance(getattr(func, "_opname", None), str) else str(func).split(".")[-2]


def _functional_group(args, kwargs) -> dist.ProcessGroup | None:
    """The process group a functional collective names (its group_name string argument)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    names = [a for a in (*args, *kwargs.values()) if isinstance(a, str)]
    for name in reversed(names):  # the group name is the last string argument (a reduce op comes before it)
        try:
            return _resolve_process_group(name)  # type: ignore[arg-type]  # GroupName: a NewType of str
        except (RuntimeError, ValueError, KeyError):
            continue
    return None


@contextlib.contextmanager
def _alias_recorder(recorder: CollectiveRecorder):
    """Wrap the functions megatron's grad buffer calls through its module-level aliases."""
    try:
        from megatron.core.distributed import param_and_grad_buffer as pgb
    except ImportError:
        yield
        return
    saved = {"rs": pgb.dist_reduce_scatter_func, "ag": pgb.dist_all_gather_func, "ar": dist.all_reduce}

    def wrap(fn, op, data_arg, group_pos):
        def wrapper(*args, **kwargs):
            group = kwargs.get("group", args[group_pos] if len(args) > group_pos else None)
            data = kwargs.get(data_arg[0], args[data_arg[1]] if len(args) > data_arg[1] else None)
            recorder._record(op, group, [[data]] if isinstance(data, torch.Tensor) else [], "alias")
            return fn(*args, **kwargs)
        return wrapper

    # (name, position) of the full data and position of the group in each signature
    pgb.dist_reduce_scatter_func = wrap(saved["rs"], "reduce_scatter_tensor", ("input", 1), 3)
    pgb.dist_all_gather_func = wrap(saved["ag"], "all_gather_into_tensor", ("output_tensor", 0), 2)
    dist.all_reduce = wrap(saved["ar"], "all_reduce", ("tensor", 0), 2)
    try:
        yield
    finally:
        pgb.dist_reduce_scatter_func = saved["rs"]
        pgb.dist_all_gather_func = saved["ag"]
        dist.all_reduce = saved["ar"]


@contextlib.contextmanager
def instrument(engine, recorder: CollectiveRecorder):
    """Label megatron's step stages as recorder phases: grad-finalize, optimizer-step, param-gather."""
    from megatron.core.distributed import param_and_grad_buffer as pgb

    def labelled(fn, phase):
        def wrapper(*args, **kwargs):
            with recorder.phase(phase):
                return fn(*args, **kwargs)
        return wrapper

    cfg = engine.config
    saved_cfg = {k: getattr(cfg, k, None) for k in ("finalize_model_grads_func", "grad_sync_func")}
    if saved_cfg["finalize_model_grads_func"] is not None:
        cfg.finalize_model_grads_func = labelled(saved_cfg["finalize_model_grads_func"], "grad-finalize")
    gs = saved_cfg["grad_sync_func"]
    if gs is not None:
        cfg.grad_sync_func = [labelled(f, "backward") for f in gs] if isinstance(gs, list) else labelled(gs, "backward")
    saved_step = engine.optimizer.step
    engine.optimizer.step = labelled(saved_step, "optimizer-step")
    group_cls = pgb._ParamAndGradBucketGroup
    saved_sync = group_cls.start_param_sync
    group_cls.start_param_sync = labelled(saved_sync, "param-gather")
    try:
        yield
    finally:
        for k, v in saved_cfg.items():
            setattr(cfg, k, v)
        engine.optimizer.step = saved_step
        group_cls.start_param_sync = saved_sync
