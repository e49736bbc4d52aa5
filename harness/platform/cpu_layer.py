"""The CPU layer: what megatron-core assumes about CUDA, provided on CPU tensors for gloo ranks.

Every patched point is listed in PATCHED_POINTS and has a unit test in tests/test_cpu_layer.py.
It is installed only inside CPU-tier rank processes (never when CUDA is in use) and removed by
`deactivate()`, so a rank can be reused and tests can check that nothing leaks.

Patched points (see docs/architecture.md, "megatron-core on CPU ranks"):
- torch.cuda.current_device() -> 0; device ordinals and 'cuda' devices are rewritten to 'cpu'
  by a TorchFunctionMode, so `device=torch.cuda.current_device()`, `device='cuda'`, `.cuda()`
  and `.to('cuda')` all land on the CPU.
- pin_memory=True and Tensor.pin_memory() need a driver -> dropped.
- Tensor.type() without arguments reports the CUDA type name ('torch.cuda.FloatTensor'), which
  megatron's optimizers check parameters against.
- torch.cuda.synchronize, Stream, Event, current_stream, default_stream, stream -> no-ops.
- RNG: model_parallel_cuda_manual_seed needs CUDA; `seed_rng` installs megatron's inference RNG
  tracker (its fork is a no-op, so dropout must stay 0) and seeds torch's CPU generator.
- Norms of low-precision CPU tensors are computed in float64 and cast back. torch's CPU norm kernel
  keeps one fp32 accumulator (pytorch/pytorch#169237; 1e-5 relative error on 1M randn elements
  with torch 2.13), where GPU ranks get apex / TE's blocked l2norm (~1e-7). Megatron's CPU fallback
  for the grad norm (`local_multi_tensor_l2_norm`) calls torch.norm per parameter, so the clip
  coefficient differed by ~6e-6 between layouts (TP shards change the error) and Adam turned that
  into 2.6e-5 parameter differences on `small` at TP=2 after two steps.
- Activation recompute: megatron's CheckpointFunction saves and restores "the CUDA RNG state" around
  the recomputed forward through `tensor_parallel.random._get_cuda_rng_state` (torch.cuda's
  get_rng_state: raises on the CPU build) and `_set_cuda_rng_state` (on the CPU build a silent no-op
  that queues a callback in torch.cuda's lazy-init list on every call). On CPU ranks the generator
  behind 'cuda' tensors is torch's CPU generator, so those two module attributes get / set the CPU
  generator's state; the tracker's get_states / set_states are the inference tracker's (forkless).
- Checkpoint writer: megatron's async writer (dist_checkpointing.strategies.filesystem_async) collects
  write results through one Manager queue per process, its server *spawned* (a fork after CUDA's
  initialisation is unsafe). A spawned server is a fresh interpreter that imports torch to unpickle the first
  write results: 3.5 s of CPU in every rank process's first save (`nox -s tests`: 64 rank processes, 223 s
  of its 1387 s of CPU; the save waited on it). A CPU rank has no CUDA: the server is forked from the rank.
  Patched where megatron-core has its starter (`_get_write_results_queue` in 0.16, `get_write_results_queue` in
  0.19: harness.upstream.WRITE_RESULTS_QUEUE); elsewhere it is spawned.
- Backward of autograd Functions: torch runs a custom Function's backward with no TorchFunctionMode active, so
  a megatron backward that places a tensor on `torch.cuda.current_device()` (the MoE all-to-all's reverse, the
  sequence-parallel gathers) asked the CPU build for device 0. Every Function's backward runs under the mode.
- MoE router: megatron-core 0.16's `moe_utils.router_gating_linear` reads `te_general_gemm`, a name its module
  defines only when Transformer Engine imports: without TE a NameError. Set to None there (torch's matmul).
- MoE token dispatcher: `maybe_move_tensor_to_cpu(t, as_numpy=True)` converts only CUDA tensors, so on CPU ranks
  the all-to-all's split sizes stayed tensors, which `all_to_all_single` refuses; CPU tensors become numpy
  arrays there too, as they would after the device-to-host copy.
- Collectives (harness/platform/cpu_collectives.py): gloo's all-gather of tensors of different lengths, and gloo's
  buffers released before the caller goes on (one worker thread a group, a coalesced collective drained).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from harness.platform import cpu_collectives
from harness.platform.cpu_collectives import ONE_WORKER_POINT, RELEASE_POINT, UNEVEN_POINT
from harness.platform.without_te import MOE_UTILS
from harness.upstream import WRITE_RESULTS_QUEUE, dispatcher_moves_to_cpu, write_results_queue_name

WRITER_POINT = "megatron checkpoint write-results queue (filesystem_async: its Manager forked, not spawned)"
ROUTER_POINT = "megatron MoE router's te_general_gemm (undefined without Transformer Engine -> None: torch's matmul)"
DISPATCHER_POINT = "megatron MoE dispatcher's maybe_move_tensor_to_cpu (CPU split sizes -> numpy, as after a copy)"
_DISPATCHER = "megatron.core.transformer.moe.token_dispatcher"
_ABSENT = object()  # an attribute the layer adds where megatron has none (deleted again at deactivate)
PATCHED_POINTS = (
    "torch.cuda.current_device",
    "torch.cuda.synchronize",
    "torch.cuda.Stream",
    "torch.cuda.Event",
    "torch.cuda.current_stream",
    "torch.cuda.default_stream",
    "torch.cuda.stream",
    "device= keyword (cuda / ordinal -> cpu)",
    "pin_memory= keyword",
    "Tensor.cuda",
    "Tensor.to",
    "Tensor.pin_memory",
    "Tensor.type",
    "megatron RNG tracker (seed_rng)",
    "torch.norm / Tensor.norm / torch.linalg.(vector_)norm (fp32 accumulation -> float64)",
    "megatron recompute RNG state (tensor_parallel.random._get/_set_cuda_rng_state -> CPU generator)",
    WRITER_POINT,
    "autograd Function backward (run under the device mode)",
    UNEVEN_POINT,
    ONE_WORKER_POINT,
    RELEASE_POINT,
    ROUTER_POINT,
    DISPATCHER_POINT,
)

# megatron-core module whose attributes the recompute RNG patch replaces (looked up as module globals
# by _get_all_rng_states / _set_all_rng_states, which CheckpointFunction and CheckpointWithoutOutput call).
_MEGATRON_RNG_MODULE = "megatron.core.tensor_parallel.random"
_MEGATRON_RNG_ATTRS = ("_get_cuda_rng_state", "_set_cuda_rng_state")

# megatron-core module whose per-process write-results queue the writer patch creates (looked up as a module
# global by FileSystemWriterAsync.prepare_write_data; its name per release: harness.upstream.WRITE_RESULTS_QUEUE).
_MEGATRON_WRITER_MODULE = "megatron.core.dist_checkpointing.strategies.filesystem_async"

_CPU = torch.device("cpu")


def _is_cuda_device(d: Any) -> bool:
    if isinstance(d, bool):
        return False
    if isinstance(d, int):
        return True  # a bare ordinal means a CUDA device
    if isinstance(d, str):
        return d.startswith("cuda")
    return isinstance(d, torch.device) and d.type == "cuda"


class _FakeStream:
    """Stands in for torch.cuda.Stream / Event: CPU work is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _FakeStream()

    def record(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


_NORMS = frozenset({torch.norm, torch.Tensor.norm, torch.linalg.vector_norm, torch.linalg.norm})
_LOW_PRECISION = frozenset({torch.float32, torch.bfloat16, torch.float16})


# A whole tensor's 2-norm is summed in float64 over chunks of this many elements: a float64 copy of a whole
# gradient (8 bytes an element) was the largest temporary of a training step (docs/internals.md).
NORM_CHUNK = 1 << 16


def _norm_in_float64(func, args, kwargs):
    x = args[0] if args else None
    if (not isinstance(x, torch.Tensor) or x.dtype not in _LOW_PRECISION or x.device.type != "cpu"
            or kwargs.get("out") is not None or kwargs.get("dtype") is not None):
        return func(*args, **kwargs)
    if x.numel() > NORM_CHUNK and _whole_two_norm(func, args, kwargs):
        squares = sum(chunk.double().square().sum() for chunk in x.reshape(-1).split(NORM_CHUNK))
        return squares.sqrt().to(x.dtype)
    return func(x.double(), *args[1:], **kwargs).to(x.dtype)


def _whole_two_norm(func, args, kwargs) -> bool:
    """Whether the call is the 2-norm (Frobenius for a matrix) of the whole tensor, no dim, no keepdim."""
    p = args[1] if len(args) > 1 else kwargs.get("p", kwargs.get("ord"))
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    keepdim = args[3] if len(args) > 3 else kwargs.get("keepdim", False)
    two = (None, "fro") if func is torch.linalg.norm else (None, 2, 2.0, "fro")  # linalg.norm(A, 2): spectral
    return p in two and dim is None and not keepdim


def _get_rng_state_on_cpu(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    """megatron's _get_cuda_rng_state on CPU ranks: the state of torch's CPU generator (a copy)."""
    if graph_safe:
        raise RuntimeError("graph-safe (CUDA graph) RNG state requested on a CPU rank: there are no CUDA graphs here")
    return torch.get_rng_state()


def _set_rng_state_on_cpu(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    """megatron's _set_cuda_rng_state on CPU ranks: set torch's CPU generator."""
    if graph_safe:
        raise RuntimeError("graph-safe (CUDA graph) RNG state set on a CPU rank: there are no CUDA graphs here")
    torch.set_rng_state(new_state)


def _megatron_rng_module():
    """megatron-core's tensor_parallel.random, checked for the attributes the layer replaces."""
    import importlib

    module = importlib.import_module(_MEGATRON_RNG_MODULE)
    missing = [a for a in _MEGATRON_RNG_ATTRS if not callable(getattr(module, a, None))]
    if missing:
        raise RuntimeError(
            f"CPU layer: {_MEGATRON_RNG_MODULE} has no {', '.join(missing)} (activation recompute's RNG "
            "save/restore); this megatron-core version needs a different patch point in harness/platform/cpu_layer.py")
    return module


def _megatron_writer_module() -> tuple[Any, str] | None:
    """megatron-core's filesystem_async and the name of the per-process queue's starter the writer patch replaces,
    else None (its write-results server is then spawned, as megatron does)."""
    import importlib

    try:
        module = importlib.import_module(_MEGATRON_WRITER_MODULE)
    except ImportError:
        return None
    name = write_results_queue_name(module)
    return None if name is None else (module, name)


def _write_results_queue_by_fork(*_: Any, **__: Any) -> Any:
    """megatron's write-results queue on CPU ranks: the same per-process Manager queue, its server forked (0.19's
    starter takes the start method, mp_mode, which is then fork's)."""
    import importlib
    import multiprocessing

    module: Any = importlib.import_module(_MEGATRON_WRITER_MODULE)
    if module._results_queue is None:
        module._results_queue = multiprocessing.get_context("fork").Manager().Queue()
    return module._results_queue


def _moe_modules() -> tuple[Any, Any] | None:
    """megatron-core's moe_utils and token_dispatcher, or None where this megatron-core has no MoE."""
    import importlib

    try:
        return importlib.import_module(MOE_UTILS), importlib.import_module(_DISPATCHER)
    except ImportError:
        return None


def _split_sizes_to_numpy(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """megatron's maybe_move_tensor_to_cpu on CPU ranks: the tensor is on the CPU already; as numpy when asked."""
    return tensor.numpy() if as_numpy and isinstance(tensor, torch.Tensor) else tensor


class CpuDeviceMode(TorchFunctionMode):
    """Rewrites CUDA placements to the CPU for every torch call made while it is active."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _NORMS:
            return _norm_in_float64(func, args, kwargs)
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = _CPU
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to:
            args = tuple(_CPU if _is_cuda_device(a) else a for a in args)
        return func(*args, **kwargs)


class CpuLayer:
    """Install / remove the CPU layer in this process; one instance per process."""

    def __init__(self) -> None:
        self._replaced: list[tuple[Any, str, Any]] = []  # (module, attribute, its original), in patch order
        self._mode: CpuDeviceMode | None = None

    @property
    def active(self) -> bool:
        return self._mode is not None

    def _replace(self, module: Any, name: str, value: Any) -> None:
        self._replaced.append((module, name, getattr(module, name, _ABSENT)))
        setattr(module, name, value)

    def activate(self) -> None:
        if self.active:
            return
        if torch.cuda.is_available():
            raise RuntimeError("the CPU layer must not be installed in a process that uses CUDA")
        rng_module = _megatron_rng_module()  # before anything is patched: a failure leaves torch as it was
        replacements = {
            "current_device": lambda: 0,
            "synchronize": lambda *a, **k: None,
            "Stream": _FakeStream,
            "Event": _FakeStream,
            "current_stream": lambda *a, **k: _FakeStream(),
            "default_stream": lambda *a, **k: _FakeStream(),
            "stream": lambda *a, **k: contextlib.nullcontext(),
        }
        for name, value in replacements.items():
            self._replace(torch.cuda, name, value)
        for name, value in zip(_MEGATRON_RNG_ATTRS, (_get_rng_state_on_cpu, _set_rng_state_on_cpu)):
            self._replace(rng_module, name, value)
        writer = _megatron_writer_module()
        if writer is not None:
            self._replace(writer[0], writer[1], _write_results_queue_by_fork)
        moe = _moe_modules()
        if moe is not None:
            moe_utils, dispatcher = moe
            if not hasattr(moe_utils, "te_general_gemm"):  # only where Transformer Engine did not import
                self._replace(moe_utils, "te_general_gemm", None)
            if dispatcher_moves_to_cpu(dispatcher):
                self._replace(dispatcher, "maybe_move_tensor_to_cpu", _split_sizes_to_numpy)
        mode = self._mode = CpuDeviceMode()
        backward = torch.autograd.function.BackwardCFunction.apply

        def apply_under_the_mode(fn, *args):
            with mode:
                return backward(fn, *args)

        self._replace(torch.autograd.function.BackwardCFunction, "apply", apply_under_the_mode)
        for module, name, value in cpu_collectives.replacements():
            self._replace(module, name, value)
        mode.__enter__()

    def deactivate(self) -> None:
        if not self.active:
            return
        assert self._mode is not None
        self._mode.__exit__(None, None, None)
        self._mode = None
        # (a write-results queue made meanwhile stays megatron's, as one megatron made would)
        for module, name, original in reversed(self._replaced):
            if original is _ABSENT:
                delattr(module, name)
            else:
                setattr(module, name, original)
        self._replaced.clear()

    def points(self) -> tuple[str, ...]:
        """The points patched while active: PATCHED_POINTS, less those megatron-core has no need or place for (the
        writer's queue, the MoE router's and dispatcher's)."""
        names = {name for _, name, _ in self._replaced}
        optional = {WRITER_POINT: WRITE_RESULTS_QUEUE, ROUTER_POINT: ("te_general_gemm",),
                    DISPATCHER_POINT: ("maybe_move_tensor_to_cpu",)}
        return tuple(p for p in PATCHED_POINTS if p not in optional or set(optional[p]) & names)


_LAYER = CpuLayer()


def activate() -> None:
    _LAYER.activate()


def deactivate() -> None:
    _LAYER.deactivate()


def is_active() -> bool:
    return _LAYER.active


def patched_points() -> tuple[str, ...]:
    """What the active layer patched in this process (empty when inactive)."""
    return _LAYER.points() if _LAYER.active else ()


def seed_rng(seed: int, on_cpu: bool) -> None:
    """Seed torch and megatron's model-parallel RNG tracker (CPU: the no-op inference tracker)."""
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random as mp_random

    torch.manual_seed(seed)
    if on_cpu:
        mp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    else:
        mp_random.initialize_rng_tracker(force_reset=True)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
