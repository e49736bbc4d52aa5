"""Nothing caught is lost to a slower tier: every check the suites can emit is named by a test of the CI tier (not
marked `nightly`) - the planted fault that shows it failing - save the ones listed here with the reason."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUITES = ("equivalence|grad-sync|ckpt-memory|dynamic-cp|step-perf|peft-ckpt|train-memory|golden|batch-split|refit|"
          "rl-cycle")

# checks no CI-tier test names, and why
UNNAMED = {
    # every suite's `<suite>.run` (a case that did not run) is one function, planted for each suite at once
    **{f"{s}.run": "case_failed: tests/test_failed_cases.py plants an erroring case in every suite"
       for s in SUITES.split("|")},
    "rl-cycle.logprobs": "no planted fault of its own yet (replay's plants fail rl-cycle.replay first)",
}


def emitted_checks() -> set[str]:
    """`<suite>.<check>` names in harness/, as literals or as f"{SUITE}.<check>" with the module's SUITE."""
    names: set[str] = set()
    for path in (ROOT / "harness").rglob("*.py"):
        text = path.read_text()
        names |= set(re.findall(rf'"((?:{SUITES})\.[a-z0-9-]+)"', text))
        params = path.parent / "params.py"
        suite = re.search(r'SUITE\s*=\s*"([a-z-]+)"', text + (params.read_text() if params.exists() else ""))
        if suite:
            names |= {f"{suite.group(1)}.{c}" for c in re.findall(r'f"\{SUITE\}\.([a-z0-9-]+)"', text)}
    return names


def ci_tier_tests_naming(names: set[str]) -> dict[str, list[str]]:
    """check -> the CI-tier test functions whose source names it."""
    out: dict[str, list[str]] = {n: [] for n in names}
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        tree = ast.parse(path.read_text())
        module_nightly = any(isinstance(n, ast.Assign) and "mark.nightly" in ast.unparse(n.value)
                             and any(getattr(t, "id", "") == "pytestmark" for t in n.targets) for n in tree.body)
        for fn in tree.body:
            if not (isinstance(fn, ast.FunctionDef) and fn.name.startswith("test_")):
                continue
            # a parametrized test with some cases nightly keeps its other cases in the CI tier
            if module_nightly or any(ast.unparse(d) == "pytest.mark.nightly" for d in fn.decorator_list):
                continue
            text = ast.unparse(fn)
            for n in names:
                if n in text:
                    out[n].append(f"{path.name}::{fn.name}")
    return out


def test_every_check_keeps_a_planted_fault_in_the_ci_tier():
    names = emitted_checks()
    assert len(names) > 50 and {"grad-sync.plan", "rl-cycle.upstream-bias", "ckpt-memory.baseline"} <= names
    found = ci_tier_tests_naming(names)
    lost = sorted(n for n, tests in found.items() if not tests and n not in UNNAMED)
    assert not lost, f"checks no CI-tier test names (a planted fault moved to nightly, or none written): {lost}"
    stale = sorted(n for n in UNNAMED if found.get(n) and not n.endswith(".run"))
    assert not stale, f"listed as unnamed but a CI-tier test names them now: {stale}"
