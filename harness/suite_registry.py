"""The suites by contract name (docs/architecture.md, docs/suites.md): `SUITES`, name -> `module:Class`, and the
one loader of a suite by name or import path, which the parent and the ranks use alike (tests plant fake suites
by import path). Adding a suite is its package and one line here."""

from __future__ import annotations

import importlib
from typing import Any

from harness.errors import BadInput

SUITES = {
    "equivalence": "harness.suite_defs.equivalence:EquivalenceSuite",
    "grad-sync": "harness.suite_defs.grad_sync:GradSyncSuite",
    "ckpt-memory": "harness.suite_defs.ckpt_memory:CkptMemorySuite",
    "dynamic-cp": "harness.suite_defs.dynamic_cp:DynamicCPSuite",
    "step-perf": "harness.suite_defs.step_perf:StepPerfSuite",
    "peft-ckpt": "harness.suite_defs.peft_ckpt:PeftCkptSuite",
    "train-memory": "harness.suite_defs.train_memory:TrainMemorySuite",
    "golden": "harness.suite_defs.golden:GoldenSuite",
    "batch-split": "harness.suite_defs.batch_split:BatchSplitSuite",
    "refit": "harness.suite_defs.refit:RefitSuite",
    "rl-cycle": "harness.suite_defs.rl_cycle:RLCycleSuite",
}


def load_suite(name: str) -> Any:
    """A new suite object by contract name, or by import path `package.module:Class`."""
    target = SUITES.get(name, name)
    if ":" not in target:
        raise BadInput(f"unknown suite {name!r}; available: {', '.join(SUITES)}")
    module, _, attr = target.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)()
    except (ImportError, AttributeError) as exc:
        raise BadInput(f"suite {name!r} cannot be loaded: {exc}") from exc
