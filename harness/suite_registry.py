"""The suites by contract name (docs/architecture.md, docs/suites.md): `SUITES`, name -> `SuiteSpec`, and the one
loader of a suite by name or import path, which the parent and the ranks use alike (tests plant fake suites by
import path). A suite's facts that the harness reads without importing the suite (its package may import torch)
are on its spec; adding a suite is its package and one line here."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from harness.backends import Backend
from harness.dtypes import DType
from harness.errors import BadInput


@dataclass(frozen=True)
class Run:
    """One run of a suite by the regression suites (suites/test_*.py): on a model (None: the suite's default for
    the backend); cpu_only: its figures are recorded for CPU ranks only, so elsewhere it is skipped."""

    model: str | None = None
    cpu_only: bool = False


@dataclass(frozen=True)
class SuiteSpec:
    """A suite, as torchtitan's ModelSpec holds a model: its class and the facts read before it is loaded."""

    suite: str  # its class, `package.module:Class`
    params: tuple[str, ...] = ()  # its parameter types whose fields declare flags (modules that import no torch)
    # why its plans know dense models only (docs/moe.md); None: it judges a mixture-of-experts model (its experts by
    # global index, its EP / ETP layouts, its auxiliary loss)
    moe_refusal: str | None = None
    # every run of it in the regression suites (suites/test_*.py; tests/test_baselines.py holds them to it): what
    # `harness baselines record --missing` records where a platform lacks it
    runs: tuple[Run, ...] = (Run(),)
    gpu_model: str | None = None  # the model it runs on NCCL ranks when none is given (None: its own)
    gpu_dtype: str | None = None  # the dtype its cases train in on NCCL ranks when none is given (None: fp32)
    # its baselines are recorded per stack (memory peaks, step times, export peaks move with Python, torch and
    # megatron-core); False: they must hold across stacks (numerics), one file judges every stack
    stack_bound: bool = True


_SD = "harness.suite_defs"
SUITES: dict[str, SuiteSpec] = {
    "equivalence": SuiteSpec(f"{_SD}.equivalence:EquivalenceSuite", runs=(Run(), Run("tiny-moe"))),
    "grad-sync": SuiteSpec(f"{_SD}.grad_sync:GradSyncSuite", runs=(Run(), Run("tiny-moe"))),
    "ckpt-memory": SuiteSpec(f"{_SD}.ckpt_memory:CkptMemorySuite", runs=(Run(), Run("tiny-moe")),
                             params=(f"{_SD}.ckpt_memory.params:CkptMemoryParams",
                                     f"{_SD}.ckpt_memory.params:CkptCaseParams")),
    "dynamic-cp": SuiteSpec(f"{_SD}.dynamic_cp:DynamicCPSuite",
                            moe_refusal="its packed-sequence engine builds dense layers only"),
    # `small` is launch-bound on an H100 (0.2 TFLOP/s, MFU 0.0%), so on GPU ranks it times the 1B shape that fits
    # one GPU, in bf16 mixed precision as Megatron users train (docs/step-perf.md has fp32 and bf16 figures)
    "step-perf": SuiteSpec(f"{_SD}.step_perf:StepPerfSuite", runs=(Run(), Run("tiny-moe", cpu_only=True)),
                           params=(f"{_SD}.step_perf.params:StepPerfParams",), gpu_model="1b-2k", gpu_dtype="bf16"),
    "peft-ckpt": SuiteSpec(f"{_SD}.peft_ckpt:PeftCkptSuite", runs=(Run(), Run("tiny-qwen3-moe"))),
    "train-memory": SuiteSpec(f"{_SD}.train_memory:TrainMemorySuite", runs=(Run(), Run("small-moe", cpu_only=True)),
                              params=(f"{_SD}.train_memory.params:TrainMemoryParams",)),
    "golden": SuiteSpec(f"{_SD}.golden:GoldenSuite", runs=(Run(), Run("tiny-moe", cpu_only=True)),
                        params=(f"{_SD}.golden.params:GoldenParams",), stack_bound=False),
    "batch-split": SuiteSpec(f"{_SD}.batch_split:BatchSplitSuite", runs=(Run(), Run("tiny-moe")),
                             params=(f"{_SD}.batch_split.params:BatchSplitParams",)),
    "refit": SuiteSpec(f"{_SD}.refit:RefitSuite", runs=(Run(), Run("tiny-moe")),
                       params=(f"{_SD}.refit.params:RefitParams",)),
    "rl-cycle": SuiteSpec(f"{_SD}.rl_cycle:RLCycleSuite", runs=(Run(), Run("tiny-moe")),
                          params=(f"{_SD}.rl_cycle.params:RLCycleParams",)),
}


def spec_of(name: str) -> SuiteSpec:
    """A registered suite's spec; a suite given by import path has the defaults (dense and MoE, no GPU defaults)."""
    return SUITES.get(name) or SuiteSpec(name)


def default_dtype(suite_name: str, backend: Backend) -> DType:
    """The dtype a suite's cases train in when none is given: fp32, or on NCCL ranks the suite's GPU one."""
    gpu = spec_of(suite_name).gpu_dtype
    return DType(gpu) if gpu and backend == Backend.NCCL else DType.fp32


def load_suite(name: str) -> Any:
    """A new suite object by contract name, or by import path `package.module:Class`."""
    target = SUITES[name].suite if name in SUITES else name
    if ":" not in target:
        raise BadInput(f"unknown suite {name!r}; available: {', '.join(SUITES)}")
    module, _, attr = target.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)()
    except (ImportError, AttributeError) as exc:
        raise BadInput(f"suite {name!r} cannot be loaded: {exc}") from exc
