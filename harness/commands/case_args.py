"""The flags that select a suite's cases, shared by run, baselines, bisect, bisect-step and compare: registered once
here (`add_case_args`); read into a `harness.selection.CaseSelection`."""

from __future__ import annotations

import argparse

from harness.platform.backend import BACKENDS
from harness.selection import DEFAULT_WORLD_SIZE, OPTION_DEFAULTS
from harness.suite_defs.flags import param_flags
from harness.suite_registry import SUITES


def add_case_args(p: argparse.ArgumentParser, compare: bool = False, suite_required: bool = True) -> None:
    """The flags that select a suite's cases (compare: the suite defaults to step-perf and --engine may be
    given twice, A then B; suite_required=False: the command checks --suite itself)."""
    if compare:
        p.add_argument("--suite", default="step-perf", help="step-perf (the suite whose step times are compared)")
        p.add_argument("--engine", action="append", help="A then B (twice), or the engine of both sides (once)")
    else:
        p.add_argument("--suite", required=suite_required, help=f"{', '.join(SUITES)}, or package.module:Suite")
    p.add_argument("--model", default=None, help="model spec (default: the suite's CPU model, tiny or small)")
    p.add_argument("--world-size", type=int, default=DEFAULT_WORLD_SIZE, help="ranks per case (default 4)")
    p.add_argument("--layout", action="append", help="layout id (repeatable); default: the suite's matrix")
    if not compare:
        p.add_argument("--engine", default="mcore", help="mcore, or a user engine package.module:factory")
    p.add_argument("--backend", default="auto", choices=BACKENDS)
    p.add_argument("--steps", type=int, default=OPTION_DEFAULTS.steps)
    p.add_argument("--seed", type=int, default=OPTION_DEFAULTS.seed)
    p.add_argument("--dtype", default=None, choices=["fp32", "bf16"],
                   help="default fp32; step-perf on NCCL ranks bf16 (mixed precision, as Megatron users train)")
    p.add_argument("--distributed-optimizer", action="store_true", help="use_distributed_optimizer=True")
    p.add_argument("--overlap-grad-reduce", action="store_true")
    p.add_argument("--recompute", default=OPTION_DEFAULTS.recompute, choices=["", "full", "selective"],
                   help="activation recompute: full (every layer) or selective (core attention); default off")
    p.add_argument("--micro-batch-size", type=int, default=None, help="samples per micro-batch (default: the model's)")
    p.add_argument("--timeout", type=float, default=None, help="per-case timeout in seconds (default 300)")
    for pf in param_flags():  # the suites' own parameters, as their types declare them
        if pf.kind == "bool":
            p.add_argument(pf.flag, action="store_true", help=pf.help)
        elif pf.kind == "list":
            p.add_argument(pf.flag, action="append", help=pf.help)
        else:
            p.add_argument(pf.flag, type={"int": int, "float": float}.get(pf.kind, str), default=None, help=pf.help)
