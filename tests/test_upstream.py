"""The one place for what differs between the tested stacks (harness/upstream.py, harness/stack.py): every upstream
name the harness imports is there on the installed stack, the probes tell the releases apart, a path the installed
releases cannot run together is refused naming the upstream issue, and a stack is named in full."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from harness import stack, upstream
from harness.errors import NotOnThisStack

ROOT = Path(__file__).resolve().parents[1]


def _imports(package: str) -> dict[tuple[str, str], str]:
    """(module, name) -> where, for every `from <package>... import name` in harness/ but harness/upstream.py (whose
    names differ between releases and are probed there)."""
    out: dict[tuple[str, str], str] = {}
    for path in sorted((ROOT / "harness").rglob("*.py")):
        if path.name == "upstream.py" and path.parent.name == "harness":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == package:
                for alias in node.names:
                    out.setdefault((node.module, alias.name), f"{path.relative_to(ROOT)}:{node.lineno}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == package:
                        out.setdefault((alias.name, ""), f"{path.relative_to(ROOT)}:{node.lineno}")
    return out


def test_every_megatron_core_name_the_harness_imports_is_on_the_installed_stack():
    names = {k: v for k, v in _imports("megatron").items() if not k[0].startswith("megatron.bridge")}
    assert len(names) > 30  # the harness's reach into megatron-core, as parsed
    missing = []
    for (module, name), where in names.items():
        try:
            mod = importlib.import_module(module)
            if name and not hasattr(mod, name):
                importlib.import_module(f"{module}.{name}")  # `from pkg import submodule`
        except ImportError as exc:
            missing.append(f"{where}: from {module} import {name} ({exc})")
    assert not missing, ("names that differ between releases go through harness/upstream.py:\n"
                         + "\n".join(missing))


@pytest.mark.slow  # starts an interpreter that imports torch and megatron (seconds each)
def test_every_bridge_name_the_harness_imports_is_on_the_installed_stack():
    pytest.importorskip("transformers")
    from harness.engines.megatron_bridge_import import import_bridge

    import_bridge()  # megatron.bridge behind its scoped stub of CUDA-only packages
    for (module, name), where in {**_imports("megatron"), **_imports("mbridge")}.items():
        if module.split(".")[0] == "mbridge" or module.startswith("megatron.bridge"):
            mod = importlib.import_module(module)
            assert not name or hasattr(mod, name), f"{where}: {module} has no {name}"


def test_the_probes_answer_on_the_installed_stack():
    import dataclasses

    from megatron.core import utils
    from megatron.core.optimizer import OptimizerConfig

    has_hybrid_arg = "is_hybrid_cp" in __import__("inspect").signature(utils.get_batch_on_this_cp_rank).parameters
    fields = {f.name for f in dataclasses.fields(OptimizerConfig)}
    assert (upstream.skip_threshold_field() is not None) == ("grad_norm_skip_threshold" in fields)
    # the releases tested: 0.16.1 has neither the new CP split argument nor the frozen mark; 0.19.2 has both
    assert upstream.frozen_expert_bias_honoured() == has_hybrid_arg
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    assert upstream.write_results_queue_name(filesystem_async) in upstream.WRITE_RESULTS_QUEUE


def test_mbridge_that_cannot_build_on_this_megatron_is_refused_naming_the_issue_and_the_fix(monkeypatch):
    """mbridge 0.15.1 reads ModelType.encoder_and_decoder, gone since megatron-core 0.18 (mbridge#155): refused in the
    parent; an mbridge that no longer reads it (faked here: none is released) runs, with no code change."""
    from harness.engines import mbridge

    sources = {"mbridge.core.util": "if model_type == ModelType.encoder_and_decoder:",
               "megatron.core.enums": "class ModelType(enum.Enum):\n    encoder_or_decoder = 1\n"}
    monkeypatch.setattr(upstream, "_source", lambda module: sources.get(module, ""))
    with pytest.raises(NotOnThisStack) as refused:
        mbridge.check_available()
    said = str(refused.value)
    assert "mbridge#155" in said and "ModelType.encoder_and_decoder" in said and "--engine megatron-bridge" in said
    assert "R2" in said and "goes unjudged on the mbridge path" in said and "\n" not in said
    sources["mbridge.core.util"] = "if model_type == ModelType.encoder_or_decoder:"  # a fixed mbridge
    mbridge.check_available()
    sources["mbridge.core.util"] = "if model_type == ModelType.encoder_and_decoder:"
    sources["megatron.core.enums"] += "    encoder_and_decoder = 2\n"  # a megatron-core that still has it
    mbridge.check_available()


def test_the_installed_mbridge_is_judged_by_the_probe():
    from harness.engines import mbridge

    if upstream.mbridge_build_refusal() is None:
        mbridge.check_available()
    else:
        with pytest.raises(NotOnThisStack, match="mbridge#155"):
            mbridge.check_available()


def test_a_known_defect_names_its_issue_and_the_release_that_fixes_it(monkeypatch):
    defect = upstream.KnownDefect("NVIDIA/Megatron-LM#4785", "the bias moves", "megatron-core", "0.17.0",
                                  lambda: False)
    assert defect.present()
    assert defect.said() == ("known upstream defect (NVIDIA/Megatron-LM#4785): the bias moves; fixed in "
                             "megatron-core 0.17.0")
    monkeypatch.setattr(upstream, "_version", lambda dist: "0.19.2")
    unfixed = upstream.KnownDefect("x/y#1", "it breaks", "megatron-core", None, lambda: False)
    assert unfixed.said().endswith("not fixed in any megatron-core release up to 0.19.2")
    assert not upstream.KnownDefect("x/y#1", "", "megatron-core", None, lambda: True).present()


def test_a_stack_is_named_in_full_and_two_stacks_say_what_differs():
    old = {"python": "3.11.7", "torch": "2.13.0+cpu", "megatron-core": "0.16.1", "megatron-bridge": "0.3.1",
           "mbridge": "0.15.1"}
    new = {"python": "3.12.1", "torch": "2.13.0 (CUDA build)", "megatron-core": "0.19.2", "megatron-bridge": "0.6.2",
           "mbridge": "0.15.1"}
    assert stack.differences(old, new) == ["Python 3.11.7 -> 3.12.1", "torch 2.13.0+cpu -> 2.13.0 (CUDA build)",
                                           "megatron-core 0.16.1 -> 0.19.2", "megatron-bridge 0.3.1 -> 0.6.2"]
    assert stack.describe(new) == ("Python 3.12.1, torch 2.13.0 (CUDA build), megatron-core 0.19.2, "
                                   "megatron-bridge 0.6.2, mbridge 0.15.1")
    assert stack.key(old) == "py3.11-torch2.13.0-cpu-mcore0.16.1"
    assert stack.key(new) == "py3.12-torch2.13.0-cuda-mcore0.19.2"
    here = stack.components()
    assert here["python"] and here["megatron-core"] and stack.key() == stack.key(here)


def test_a_megatron_core_outside_the_tested_range_warns_in_one_line():
    assert stack.tested_range() == "0.16.1 - 0.19.2"
    assert stack.untested_warning({"megatron-core": "0.19.2"}) is None
    assert stack.untested_warning({"megatron-core": "0.16.1"}) is None
    said = stack.untested_warning({"megatron-core": "0.20.0"})
    assert said is not None and "\n" not in said
    assert "megatron-core 0.20.0 is outside the range the harness is tested on (0.16.1 - 0.19.2)" in said


def test_the_nightly_runs_another_stack_by_its_python_and_refuses_its_own(tmp_path):
    import json
    import sys

    from harness.errors import BadInput
    from harness.nightly import other_stacks, worst_exit

    here = stack.components()
    other = {**here, "python": "3.11.7", "megatron-core": "0.16.1"} if here["megatron-core"] != "0.16.1" else \
        {**here, "python": "3.12.1", "megatron-core": "0.19.2"}  # the stack this one is not
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\necho '{json.dumps(other)}'\n")
    fake.chmod(0o755)
    assert other_stacks([f"previous={fake}"]) == {("previous", str(fake)): stack.key(other)}
    with pytest.raises(BadInput, match="is one the nightly already runs"):
        other_stacks([f"same={sys.executable}"])
    assert worst_exit([0, 1, 3]) == 1 and worst_exit([0, 3]) == 3 and worst_exit([0, 0]) == 0
    assert worst_exit([1, 143]) == 143


def test_a_transformers_outside_megatron_bridges_range_is_named(monkeypatch):
    import importlib.metadata as md

    reqs = {"megatron-bridge": ["transformers<=5.12.1,>=5.8", "torch>=2.6.0", 'mamba-ssm; extra == "ssm"']}
    versions = {"megatron-bridge": "0.6.2", "transformers": "4.57.6"}
    monkeypatch.setattr(md, "requires", lambda dist: reqs[dist])
    monkeypatch.setattr(md, "version", lambda dist: versions[dist])
    said = upstream.bridge_transformers_mismatch()
    assert said == ("megatron-bridge 0.6.2 needs transformers <=5.12.1,>=5.8, this environment has 4.57.6: "
                    "pip install 'transformers<=5.12.1,>=5.8'")
    versions["transformers"] = "5.12.1"
    assert upstream.bridge_transformers_mismatch() is None
