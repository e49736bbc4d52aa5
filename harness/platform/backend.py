"""Which collective backend and device a rank uses, and the platform key baselines are filed under."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from harness.backends import BACKENDS, Backend
from harness.errors import BadInput

# The environment of every gloo (CPU-tier) rank process: it sees no GPU, so on a GPU node (e.g. world size
# 4 on a one-GPU node, where `auto` picks gloo) the CPU layer runs as on a CPU box instead of refusing a
# process where CUDA is available, and no rank holds a CUDA context it does not use.
# It runs ATen on one thread: with more, each gloo thread that copies an all-gather's output starts an OpenMP
# pool of its own, and once a process's OpenMP threads outnumber the cores libgomp makes every small parallel
# op wait for a wake-up, for the rest of the rank's life (docs/internals.md, "One thread per CPU rank").
CPU_RANK_THREADS = 1
# TORCHDYNAMO_DISABLE: megatron's torch.compile'd functions (jit_fuser) run eagerly on CPU ranks. megatron-core 0.19
# calls some on the MoE path there, and inductor then compiled and loaded a C++ kernel inside a measured phase,
# which crashed memray 1.20's tracker when it stopped (a bus error or segfault in the rank: train-memory's small-moe
# with the distributed optimizer, refit); they are fused kernels for GPUs (adjustments: COMPILE_OFF).
CPU_RANK_ENV = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": str(CPU_RANK_THREADS), "TORCHDYNAMO_DISABLE": "1"}
COMPILE_OFF = "torch.compile off on CPU ranks (megatron's jit_fuser functions run eagerly: TORCHDYNAMO_DISABLE=1)"
# A GPU rank compiles megatron's fused functions (jit_fuser is torch.compile there) in its own process: inductor's
# default compile pool is a worker process with threads, started at the first compile - whichever case that is
# in a warm rank, which then reads as that case's leak (measured on an H100: 2 threads and a child process).
GPU_RANK_ENV = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}


def cpu_share(local_world_size: int | None = None) -> int:
    """The cores of this node per rank (at least 1): local_world_size, or LOCAL_WORLD_SIZE in a rank."""
    ranks = local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, (os.cpu_count() or 1) // max(1, ranks))


@dataclass(frozen=True)
class Platform:
    backend: Backend  # gloo | nccl
    device: str  # cpu | cuda
    device_name: str  # e.g. "cpu", "NVIDIA H100 80GB HBM3"

    @property
    def key(self) -> str:
        """Baseline platform key: cpu-gloo, nccl-h100-80gb, ..."""
        if self.backend == Backend.GLOO:
            return "cpu-gloo"
        name = self.device_name.lower().replace("nvidia", "")
        m = re.search(r"([a-z]\d{2,4})\D*?(\d+)\s*gb", name)
        slug = f"{m.group(1)}-{m.group(2)}gb" if m else re.sub(r"[^a-z0-9]+", "-", name).strip("-")
        return f"nccl-{slug}"


def machine_fingerprint(backend: Backend) -> str:
    """What a step time depends on besides the code: on NCCL ranks the GPU model and count; on gloo ranks the CPU
    model, the core count and the boot of this machine (Linux's boot_id). Time baselines judge only the machine
    they were recorded on.

    Why the boot on CPU: 2-core VMs of one CPU model and core count, cloned from one image (the same
    /etc/machine-id), ran the same step-perf cases (`small` at world size 4) x1.34-1.73 slower than the VM
    that recorded the baseline, while within one boot unplanted runs read x0.92-1.17 of their baseline: model
    and core count cannot tell such machines apart (docs/step-perf.md). A reboot of a workstation is a new
    machine for time baselines (re-record). A VM restored from a snapshot of another keeps its boot id, so
    step-perf also bounds a CPU time baseline's age (`CPU_TIME_BASELINE_HOURS`)."""
    if backend == Backend.NCCL:
        return f"{detect_platform(Backend.NCCL).device_name} x{cuda_device_count()}"
    import platform

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f", boot {f.read().strip()[:8]}"
    except OSError:
        boot = ""  # no boot id (not Linux): the model and core count only
    return f"{model} x{os.cpu_count()}{boot}"


# Where none of these exists the host has no GPU driver (NVIDIA's, ROCm's, WSL2's, Jetson's) and torch would
# count 0 GPUs: the harness process then plans and judges without importing torch (~3 s of CPU of a `harness
# run` on 2 cores; its ranks import it anyway).
GPU_DRIVER_PATHS = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/kfd", "/dev/dxg", "/dev/nvhost-ctrl-gpu")


def cuda_device_count() -> int:
    if not any(os.path.exists(p) for p in GPU_DRIVER_PATHS):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpus_from_device_files() -> int:
    """This node's GPUs as its device files (and CUDA_VISIBLE_DEVICES) count them, without torch: where the
    backend decides whether ranks may see a GPU at all, once torch has asked CUDA hiding them comes too late."""
    import glob

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([v for v in visible.split(",") if v.strip()])
    return len([d for d in glob.glob("/dev/nvidia*") if re.fullmatch(r"/dev/nvidia\d+", d)])


def resolve_backend(requested: str, world_size: int | None = None, gpus: int | None = None) -> Backend:
    """The one resolver of a requested backend: auto -> nccl when there are GPUs enough for one rank each (of
    world_size: the ranks on this node), else gloo; nccl without them is BadInput. gpus: this node's count where
    the caller has it (None: cuda_device_count)."""
    if requested not in BACKENDS:
        raise BadInput(f"unknown backend {requested!r}; choose one of {', '.join(BACKENDS)}")
    gpus = cuda_device_count() if gpus is None else gpus
    if requested == Backend.AUTO:
        return Backend.NCCL if gpus and (world_size is None or world_size <= gpus) else Backend.GLOO
    if requested == Backend.NCCL and world_size is not None and world_size > gpus:
        raise BadInput(
            f"backend nccl needs one GPU per rank: world size {world_size} but {gpus} GPU(s) visible; "
            "use --backend gloo or a smaller --world-size"
        )
    return Backend(requested)


def memory_per_rank(backend: Backend, local_world_size: int) -> int:
    """Bytes one rank may use: its GPU's memory (one rank per GPU), or on gloo ranks the host's available
    memory divided among the ranks on this host."""
    if backend == Backend.NCCL:
        import torch

        return torch.cuda.get_device_properties(0).total_memory
    import psutil

    return psutil.virtual_memory().available // max(1, local_world_size)


def detect_platform(backend: Backend) -> Platform:
    if backend == Backend.NCCL:
        import torch

        return Platform(Backend.NCCL, "cuda", torch.cuda.get_device_name(0))
    return Platform(Backend.GLOO, "cpu", "cpu")
