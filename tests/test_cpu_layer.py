"""Each point the CPU layer patches, checked on its own; and that removing it leaves nothing behind."""

from __future__ import annotations

import pytest
import torch

from harness.platform import cpu_collectives, cpu_layer


@pytest.fixture
def layer():
    cpu_layer.activate()
    try:
        yield
    finally:
        cpu_layer.deactivate()


# One test per entry of cpu_layer.PATCHED_POINTS (test_every_point_is_tested keeps them in step).
COVERED = {}


def covers(point):
    def mark(fn):
        COVERED[point] = fn.__name__
        return fn
    return mark


@covers("torch.cuda.current_device")
def test_current_device_places_on_cpu(layer):
    assert torch.cuda.current_device() == 0
    assert torch.empty(2, device=torch.cuda.current_device()).device.type == "cpu"


@covers("device= keyword (cuda / ordinal -> cpu)")
def test_cuda_device_keyword_is_rewritten(layer):
    for dev in ("cuda", "cuda:0", 0, torch.device("cuda", 0)):
        assert torch.zeros(3, device=dev).device.type == "cpu", dev
    assert torch.tensor([1.0], device="cuda").device.type == "cpu"
    assert torch.ones(2).new_zeros(2, device="cuda").device.type == "cpu"


@covers("pin_memory= keyword")
def test_pin_memory_keyword_is_dropped(layer):
    assert torch.empty(4, pin_memory=True).device.type == "cpu"


@covers("Tensor.cuda")
def test_tensor_cuda_is_identity(layer):
    t = torch.ones(2)
    assert t.cuda() is t
    assert t.cuda(0) is t


@covers("Tensor.to")
def test_tensor_to_cuda_stays_on_cpu(layer):
    t = torch.ones(2)
    assert t.to("cuda").device.type == "cpu"
    assert t.to(0).device.type == "cpu"
    assert t.to(device="cuda").device.type == "cpu"
    half = t.to("cuda", torch.float16)
    assert half.device.type == "cpu" and half.dtype == torch.float16
    assert t.to(torch.float64).dtype == torch.float64  # non-device uses untouched


@covers("Tensor.pin_memory")
def test_tensor_pin_memory_is_identity(layer):
    t = torch.ones(2)
    assert t.pin_memory() is t


@covers("Tensor.type")
def test_tensor_type_reports_cuda_names(layer):
    assert torch.ones(1).type() == "torch.cuda.FloatTensor"
    assert torch.ones(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert torch.nn.Parameter(torch.ones(1).half()).type() == "torch.cuda.HalfTensor"
    assert torch.ones(1).type(torch.float64).dtype == torch.float64  # conversion still works


@covers("torch.cuda.synchronize")
def test_synchronize_is_noop(layer):
    assert torch.cuda.synchronize() is None
    cpu_layer.deactivate()
    _raises_without_layer(torch.cuda.synchronize)


def _raises_without_layer(call) -> None:
    """The point needs the layer: on the CPU build of torch the real call raises."""
    with pytest.raises((AssertionError, RuntimeError, AttributeError, TypeError, ValueError)):
        call()


@covers("torch.cuda.Stream")
def test_stream_objects_are_inert(layer):
    s = torch.cuda.Stream()
    assert s.wait_stream(torch.cuda.current_stream()) is None
    assert s.synchronize() is None
    assert s.query() is True  # CPU work is already done when the call returns
    cpu_layer.deactivate()
    _raises_without_layer(lambda: torch.cuda.Stream().synchronize())


@covers("torch.cuda.Event")
def test_event_objects_are_inert(layer):
    e = torch.cuda.Event(enable_timing=True)
    assert e.record() is None and e.synchronize() is None
    assert e.query() is True
    cpu_layer.deactivate()
    _raises_without_layer(lambda: torch.cuda.Event(enable_timing=True).record())


@covers("torch.cuda.current_stream")
def test_current_stream(layer):
    stream = torch.cuda.current_stream()
    assert stream.wait_event(torch.cuda.Event()) is None and stream.synchronize() is None
    cpu_layer.deactivate()
    _raises_without_layer(torch.cuda.current_stream)


@covers("torch.cuda.default_stream")
def test_default_stream(layer):
    assert torch.cuda.default_stream().synchronize() is None
    cpu_layer.deactivate()
    _raises_without_layer(torch.cuda.default_stream)


@covers("torch.cuda.stream")
def test_stream_context(layer):
    with torch.cuda.stream(torch.cuda.Stream()):
        x = torch.ones(1, device="cuda")
    assert x.device.type == "cpu"
    cpu_layer.deactivate()
    _raises_without_layer(lambda: torch.cuda.stream(torch.cuda.Stream()).__enter__())


@covers("megatron RNG tracker (seed_rng)")
def test_seed_rng_installs_forkless_tracker(layer):
    from megatron.core.tensor_parallel import random as mp_random

    cpu_layer.seed_rng(7, on_cpu=True)
    a = torch.rand(3)
    with mp_random.get_cuda_rng_tracker().fork():  # no CUDA RNG: a no-op on CPU ranks
        pass
    cpu_layer.seed_rng(7, on_cpu=True)
    assert torch.equal(a, torch.rand(3))
    mp_random._CUDA_RNG_STATE_TRACKER = None
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = False


@covers("torch.norm / Tensor.norm / torch.linalg.(vector_)norm (fp32 accumulation -> float64)")
def test_fp32_norms_are_accurate(layer):
    # 1M elements: torch's CPU kernel is off by ~1e-5 here (pytorch#169237); GPU kernels by ~1e-7
    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(0))
    exact = float(x.double().norm())
    for norm in (torch.norm(x), x.norm(), x.norm(2), torch.linalg.vector_norm(x), torch.linalg.norm(x)):
        assert norm.dtype == torch.float32
        assert abs(float(norm) / exact - 1) < 1e-7
    rows = torch.linalg.vector_norm(x.view(1024, 1024), dim=1)
    assert rows.shape == (1024,) and rows.dtype == torch.float32
    w = torch.randn(8, requires_grad=True)
    torch.norm(w).backward()  # still differentiable, gradient in the parameter's dtype
    assert w.grad.dtype == torch.float32 and torch.allclose(w.grad, (w / w.norm()).detach())
    big = torch.randn(1 << 17, requires_grad=True)  # over NORM_CHUNK: summed in chunks, differentiable as well
    torch.norm(big).backward()
    assert big.grad.dtype == torch.float32 and torch.allclose(big.grad, (big / big.norm()).detach())
    spectral = torch.linalg.norm(x.view(1024, 1024), 2)  # linalg.norm(A, 2) is no 2-norm of the elements
    assert abs(float(spectral) / float(torch.linalg.matrix_norm(x.view(1024, 1024).double(), 2)) - 1) < 1e-6


def test_a_norm_makes_no_float64_copy_of_the_whole_tensor(layer, tmp_path):
    """A step's largest temporary was the float64 copy of a whole gradient (8 MiB for 1M elements), which stood
    on top of a late-freed gloo buffer in train-memory's intermittent excess; chunked it is below 2 MiB."""
    import memray

    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(0))
    exact = torch.norm(x.double()).float()
    with memray.Tracker(tmp_path / "norm.bin"):
        norm = torch.norm(x)
    peak = memray.FileReader(tmp_path / "norm.bin").metadata.peak_memory
    assert peak < 2 * 2**20, f"{peak / 2**20:.2f} MiB"
    assert norm.item() == exact.item()  # the same float32 value as the whole float64 norm


@covers("megatron recompute RNG state (tensor_parallel.random._get/_set_cuda_rng_state -> CPU generator)")
def test_recompute_rng_state_is_the_cpu_generator(layer):
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random as mp_random

    queued = len(getattr(torch.cuda, "_queued_calls", []))
    cpu_layer.seed_rng(3, on_cpu=True)
    try:
        state = mp_random._get_cuda_rng_state()
        assert torch.equal(state, torch.get_rng_state())
        a = torch.rand(4, device="cuda")
        mp_random._set_cuda_rng_state(state)  # the CPU generator goes back: the same draw again
        assert torch.equal(torch.rand(4), a)
        with pytest.raises(RuntimeError, match="no CUDA graphs"):
            mp_random._get_cuda_rng_state(graph_safe=True)

        # Activation recompute: the backward's re-run of the forward draws what the forward drew,
        # and leaves the generator where the forward left it. The backward is started the way
        # megatron's schedules start it (custom_backward, deallocate_pipeline_outputs=True as the
        # engines set): Tensor.backward / torch.autograd.backward dispatch through the layer's
        # TorchFunctionMode, which torch suspends for the whole call, recompute included.
        from megatron.core.pipeline_parallel.schedules import custom_backward

        def f(t):
            return t * torch.rand(6, device="cuda")  # a dropout-like mask from the 'cuda' generator

        x = torch.randn(6, requires_grad=True)
        torch.manual_seed(5)
        ref = f(x)
        custom_backward(ref.sum().view(1), torch.ones(1))
        ref_grad, x.grad = x.grad.clone(), None
        torch.manual_seed(5)
        out = tensor_parallel.checkpoint(f, False, x)
        after_forward = torch.get_rng_state()
        custom_backward(out.sum().view(1), torch.ones(1))
        assert torch.equal(out, ref) and torch.equal(x.grad, ref_grad)
        assert torch.equal(torch.get_rng_state(), after_forward)
        assert len(getattr(torch.cuda, "_queued_calls", [])) == queued  # nothing queued for a CUDA init
    finally:
        mp_random._CUDA_RNG_STATE_TRACKER = None
        mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
    cpu_layer.deactivate()
    assert mp_random._set_cuda_rng_state.__module__ == mp_random.__name__  # megatron's own again
    _raises_without_layer(mp_random._get_cuda_rng_state)


def test_activate_names_a_missing_megatron_rng_attribute(monkeypatch):
    from megatron.core.tensor_parallel import random as mp_random

    monkeypatch.delattr(mp_random, "_set_cuda_rng_state")
    with pytest.raises(RuntimeError, match=r"megatron\.core\.tensor_parallel\.random has no _set_cuda_rng_state"):
        cpu_layer.activate()
    assert not cpu_layer.is_active()
    assert torch.ones(1).type() == "torch.FloatTensor"  # nothing was patched
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.current_device()


def _write_results_server(fsa, sent) -> tuple[bytes, object]:
    """A fresh megatron write-results queue: (its server's command line, the queue); `sent` goes through it."""
    from pathlib import Path

    from harness.upstream import write_results_queue_name

    start = getattr(fsa, write_results_queue_name(fsa))
    fsa._results_queue = None
    queue = start()
    assert start() is queue  # one per process
    queue.put(sent)
    assert queue.get() == sent
    return Path(f"/proc/{queue._manager._process.pid}/cmdline").read_bytes(), queue


@covers(cpu_layer.WRITER_POINT)
def test_the_write_results_server_is_forked_not_spawned():
    """megatron spawns it: a new interpreter that imports torch to unpickle the results (3.5 s of CPU a rank
    process). Under the layer the server is this process forked (its command line is ours); without, spawned."""
    from pathlib import Path

    from megatron.core.dist_checkpointing.strategies import filesystem_async as fsa

    from harness.upstream import write_results_queue_name

    own, saved = Path("/proc/self/cmdline").read_bytes(), fsa._results_queue
    servers = []
    try:
        cpu_layer.activate()
        try:
            from torch.distributed.checkpoint.metadata import MetadataIndex
            from torch.distributed.checkpoint.storage import WriteResult

            forked, queue = _write_results_server(fsa, {0: [WriteResult(MetadataIndex("w"), 4, None)]})
            servers.append(queue._manager)
        finally:
            cpu_layer.deactivate()
        assert forked == own
        assert getattr(fsa, write_results_queue_name(fsa)).__module__ == fsa.__name__  # megatron's own again
        spawned, queue = _write_results_server(fsa, {0: [4]})  # the check tells the two apart (no torch to import)
        servers.append(queue._manager)
        assert spawned != own and b"multiprocessing" in spawned, spawned
    finally:
        for manager in servers:
            manager.shutdown()
        fsa._results_queue = saved


def test_a_megatron_without_the_write_results_queue_keeps_its_writer(monkeypatch):
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fsa

    from harness.upstream import WRITE_RESULTS_QUEUE, write_results_queue_name

    name = write_results_queue_name(fsa)
    assert name is not None, f"megatron-core's filesystem_async has none of {WRITE_RESULTS_QUEUE}"
    monkeypatch.delattr(fsa, name)
    cpu_layer.activate()
    try:
        assert cpu_layer.WRITER_POINT not in cpu_layer.patched_points()
        assert not hasattr(fsa, name)
    finally:
        cpu_layer.deactivate()
    assert cpu_layer.patched_points() == ()


@covers("autograd Function backward (run under the device mode)")
def test_a_functions_backward_places_on_cpu(layer):
    """torch runs a custom Function's backward without the mode; megatron's all-to-all places its reverse's output
    on torch.cuda.current_device() there."""

    class PlacesOnTheDevice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad.new_empty(grad.shape, device=torch.cuda.current_device()).copy_(grad) * 2

    x = torch.ones(3, requires_grad=True)
    PlacesOnTheDevice.apply(x).sum().backward()
    assert x.grad.tolist() == [2.0, 2.0, 2.0]


@covers(cpu_layer.ROUTER_POINT)
def test_the_moe_router_gates_with_torch_without_transformer_engine(layer):
    from megatron.core.transformer.moe import moe_utils

    assert moe_utils.te_general_gemm is None  # megatron defines it only where TE imports
    x, w = torch.randn(5, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    logits = moe_utils.router_gating_linear(x, w, None, torch.float32)
    assert torch.allclose(logits, x @ w.t())
    logits.sum().backward()
    assert x.grad is not None and w.grad is not None


@covers(cpu_layer.DISPATCHER_POINT)
def test_the_moe_dispatchers_split_sizes_are_numpy_on_cpu(layer):
    import numpy as np
    from megatron.core.transformer.moe import token_dispatcher

    splits = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 1]), as_numpy=True)
    assert isinstance(splits, np.ndarray) and splits.tolist() == [3, 1]
    kept = torch.tensor([3, 1])
    assert token_dispatcher.maybe_move_tensor_to_cpu(kept) is kept


def test_deactivate_removes_what_the_moe_points_added():
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    had_gemm, move = hasattr(moe_utils, "te_general_gemm"), token_dispatcher.maybe_move_tensor_to_cpu
    backward = torch.autograd.function.BackwardCFunction.apply
    cpu_layer.activate()
    cpu_layer.deactivate()
    assert hasattr(moe_utils, "te_general_gemm") == had_gemm
    assert token_dispatcher.maybe_move_tensor_to_cpu is move
    assert torch.autograd.function.BackwardCFunction.apply is backward


@covers("torch.distributed.all_gather of tensors of different lengths (padded on gloo)")
def test_an_uneven_all_gather_runs_on_gloo(layer, tmp_path):
    """Two gloo ranks in this process's threads cannot share a default group: a one-rank world shows the padding
    and trimming; tests/test_moe.py runs the MoE dispatcher's uneven gathers on real ranks."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        out = [torch.empty(3, 2)]
        assert dist.all_gather(out, torch.ones(3, 2)) is None and out[0].tolist() == [[1.0, 1.0]] * 3
        from harness.platform.cpu_collectives import uneven_all_gather

        calls = []

        def fake(tensor_list, tensor, group=None, async_op=False):  # what gloo sees: equal lengths only
            calls.append([tuple(t.shape) for t in tensor_list] + [tuple(tensor.shape)])
            for i, t in enumerate(tensor_list):
                t.copy_(torch.full_like(t, float(i)) if i else tensor)

        uneven = [torch.empty(3, 2), torch.empty(1, 2)]
        handle = uneven_all_gather(fake)(uneven, torch.ones(3, 2), async_op=True)
        assert handle.wait() and calls == [[(3, 2), (3, 2), (3, 2)]]
        assert uneven[0].tolist() == [[1.0, 1.0]] * 3 and uneven[1].tolist() == [[1.0, 1.0]]
    finally:
        dist.destroy_process_group()


def _heap_in_use() -> float:
    """MiB malloc holds in use (every arena and mmapped chunk), from glibc's mallinfo2."""
    import ctypes

    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = Info
    info = libc.mallinfo2()
    return (info.uordblks + info.hblkhd) / 2**20


def late_frees(rank: int, world_size: int) -> dict[str, int]:
    """On a gloo rank whose group worker shares the rank's core at idle priority (SCHED_IDLE: the waiter, woken by
    it, runs first): in how many of 12 coalesced reduce-scatters of 16 MiB, issued as megatron's gradient buffer
    issues them, gloo's clone of the input was still allocated when the block returned; and with the release taken
    out (the plant), at which of 12 it first was (0: at none)."""
    import os
    import time

    import torch.distributed as dist
    from megatron.core.distributed import param_and_grad_buffer as pgb

    from harness.platform import cpu_collectives

    def workers() -> set[int]:
        tids = set()
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    if f.read().strip() == "pt_gloo_runloop":
                        tids.add(int(tid))
            except OSError:
                pass
        return tids

    before = workers()
    group = dist.new_group(list(range(world_size)))
    dist.barrier(group)  # its worker has run, and named itself
    starved = workers() - before
    assert len(starved) == 1, f"the new group has {len(starved)} gloo worker threads"
    affinity = os.sched_getaffinity(0)
    core = {sorted(affinity)[rank % len(affinity)]}
    os.sched_setaffinity(0, core)
    for tid in starved:
        os.sched_setaffinity(tid, core)
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    grads, shard = torch.ones(4 << 20), torch.empty((4 << 20) // world_size)

    def still_held() -> bool:
        base = _heap_in_use()
        with pgb._coalescing_manager(group, async_ops=False):
            pgb.dist_reduce_scatter_func(shard, grads, group=group)
        held = _heap_in_use() - base > 8
        deadline = time.monotonic() + 10
        while _heap_in_use() - base > 8 and time.monotonic() < deadline:
            time.sleep(0.001)
        return held

    try:
        late = sum(still_held() for _ in range(12))
        release, cpu_collectives.release = cpu_collectives.release, lambda group: None
        try:
            # the plant's first late free is enough: each one waits for the starved worker to free its clone
            planted = next((i + 1 for i in range(12) if still_held()), 0)
        finally:
            cpu_collectives.release = release
    finally:
        os.sched_setaffinity(0, affinity)
        dist.destroy_process_group(group)
    return {"late": late, "planted": planted}


@covers(cpu_collectives.ONE_WORKER_POINT)
@covers(cpu_collectives.RELEASE_POINT)
@pytest.mark.slow
def test_a_coalesced_reduce_scatter_frees_gloos_clone_before_it_returns():
    """gloo's reduce-scatter clones its input; its worker thread, starved here, held the clone after the waiter went
    on (train-memory's one-rank step-1 excess). With one worker a group and the release, never; without, soon."""
    from tests.support.rank_call import on_ranks

    got = on_ranks("tests.test_cpu_layer:late_frees", 2)
    assert [g["late"] for g in got] == [0, 0], f"the clone outlived the reduce-scatter: {got}"
    assert any(g["planted"] for g in got), f"the plant (no release) freed every clone in time: {got}"


def test_every_point_is_tested():
    assert set(cpu_layer.PATCHED_POINTS) == set(COVERED), set(cpu_layer.PATCHED_POINTS) ^ set(COVERED)


def test_deactivate_restores_torch():
    cpu_layer.activate()
    cpu_layer.deactivate()
    assert not cpu_layer.is_active()
    assert torch.ones(1).type() == "torch.FloatTensor"
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.current_device()  # the CPU build has no CUDA: the real function raises again
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1, device="cuda")


def test_refuses_a_process_with_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="must not be installed"):
        cpu_layer.activate()
    assert not cpu_layer.is_active()
