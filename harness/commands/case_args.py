"""The flags that select a suite's cases, shared by run, baselines, bisect, bisect-step and compare: registered once
here (`add_case_args`); read into a `harness.selection.CaseSelection`."""

from __future__ import annotations

import argparse

from harness.selection import SHARED_FLAGS, TIMEOUT_FLAG, option_flags
from harness.suite_flags import param_flags
from harness.suite_registry import SUITES


def add_case_args(p: argparse.ArgumentParser, compare: bool = False, suite_required: bool = True) -> None:
    """The flags that select a suite's cases (compare: the suite defaults to step-perf and --engine may be
    given twice, A then B; suite_required=False: the command checks --suite itself)."""
    if compare:
        p.add_argument("--suite", default="step-perf", help="step-perf (the suite whose step times are compared)")
        p.add_argument("--engine", action="append", help="A then B (twice), or the engine of both sides (once)")
    else:
        p.add_argument("--suite", required=suite_required, help=f"{', '.join(SUITES)}, or package.module:Suite")
    for name in ("--model", "--world-size"):
        p.add_argument(name, **SHARED_FLAGS[name])
    p.add_argument("--layout", action="append", help="layout id (repeatable); default: the suite's matrix")
    if not compare:
        p.add_argument("--engine", **SHARED_FLAGS["--engine"])
    p.add_argument("--backend", **SHARED_FLAGS["--backend"])
    for pf in option_flags():  # the core training options, as CaseOptions' fields declare them
        pf.add_to(p.add_argument)
    p.add_argument("--timeout", **TIMEOUT_FLAG)
    for pf in param_flags():  # the suites' own parameters, as their types declare them
        pf.add_to(p.add_argument)
