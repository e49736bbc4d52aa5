"""The engine API (harness/engine_api.py): a user's engine written against its names alone plans and runs, every
public name is documented, and a renamed one still imports, with a warning naming its replacement."""

from __future__ import annotations

import ast
import re
import sys
import warnings
from pathlib import Path

import pytest

import harness.engine_api as api

ROOT = Path(__file__).resolve().parents[1]

# a framework's engine, as docs/engines.md shows one: it imports from the harness's public API only
SAMPLE_ENGINE = '''
from harness.engine_api import BadInput, Case, Layout, McoreEngine, MicroBatchLoss, ModelSpec, RankContext, buckets


class Engine(McoreEngine):
    """Its own loss aggregation and weight export, the harness's construction."""

    def __init__(self, case: Case, ctx: RankContext):
        super().__init__(case, ctx)
        self.aggregated = 0

    def aggregate_loss(self, inputs: MicroBatchLoss):
        self.aggregated += 1
        return super().aggregate_loss(inputs)

    def export_buckets(self, bucket_bytes: int):
        return buckets(self.hf_weight_stream(), bucket_bytes)

    @staticmethod
    def refusal(model: ModelSpec, layout: Layout) -> str | None:
        return "this engine runs no pipeline stages" if layout.pp > 1 else None


def make(case: Case, ctx: RankContext) -> Engine:
    if case.model.moe:
        raise BadInput("this engine builds dense models only")
    return Engine(case, ctx)
'''


@pytest.fixture
def sample_engine(tmp_path, monkeypatch):
    (tmp_path / "sample_rl_engine.py").write_text(SAMPLE_ENGINE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the ranks import it too
    yield "sample_rl_engine"
    sys.modules.pop("sample_rl_engine", None)


def test_the_sample_engine_imports_nothing_but_the_engine_api():
    harness_imports = {node.module for node in ast.walk(ast.parse(SAMPLE_ENGINE))
                       if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("harness")}
    assert harness_imports == {"harness.engine_api"}


def test_every_public_name_exists_and_is_listed_in_the_engines_page():
    page = (ROOT / "docs" / "engines.md").read_text()
    section = page[page.index("## The engine API"):]
    section = section[:section.index("\n## ", 1)]
    listed = set(re.findall(r"`(\w+)`", section))
    missing = [name for name in api.__all__ if name not in listed]
    assert not missing, f"docs/engines.md's engine API section does not list {missing}"
    for name in api.__all__:
        assert getattr(api, name) is not None


def test_a_renamed_public_name_still_imports_and_names_its_replacement():
    with pytest.warns(DeprecationWarning, match="hf_llama_config is deprecated: use hf_config"):
        old = api.hf_llama_config
    assert old is api.hf_config
    with pytest.warns(DeprecationWarning, match=r"use dtype\(name\)\.torch"):
        old_dtype = api.torch_dtype
    assert old_dtype("bf16") is api.dtype("bf16").torch
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert api.McoreEngine  # a current name does not warn
    with pytest.raises(AttributeError):
        api.no_such_name  # noqa: B018


def test_the_sample_engine_is_planned_and_its_refusal_heard(sample_engine):
    from harness.driver import plan
    from harness.errors import DoesNotApply

    planned = plan("equivalence", "tiny", 2, ["tp1-pp1-cp1-dp2"], engine=f"{sample_engine}:Engine", backend="gloo")
    assert {c.engine for c in planned.cases} == {f"{sample_engine}:Engine"}
    with pytest.raises(DoesNotApply, match="runs no pipeline stages"):
        plan("equivalence", "tiny", 2, ["tp1-pp2-cp1-dp1"], engine=f"{sample_engine}:Engine", backend="gloo")


@pytest.mark.slow
def test_the_sample_engine_runs_a_suite_on_ranks(sample_engine):
    from harness.driver import run_suite

    run = run_suite("equivalence", "tiny", 2, ["tp1-pp1-cp1-dp2", "tp2-pp1-cp1-dp1"], engine=f"{sample_engine}:make",
                    backend="gloo", fresh_ranks=True)
    assert run.passed, [(r.case.id, r.status, r.error[-500:]) for r in run.results]
