"""`harness project-memory` is arithmetic: it runs where torch and megatron cannot even be imported.

Each test runs a fresh interpreter whose first meta path finder refuses torch and megatron. An import attempt
fails loudly even where the code under test would swallow the ImportError: the guard records it, and the
interpreter then exits 99 with the import's stack."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from harness.checks.memory_model import MIB, project
from harness.layouts import validate
from harness.models import load_model
from harness.spec import Layout

ROOT = Path(__file__).resolve().parents[1]
GUARD_EXIT = 99

_GUARD = r'''
import os, sys, traceback
BLOCKED = ("torch", "megatron")
already = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
if already:
    print(f"GUARD: imported before the test began: {already}", file=sys.stderr)
    os._exit(98)
attempts = []

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            attempts.append(f"import of {name}:\n" + "".join(traceback.format_stack()[:-1]))
            raise ImportError(f"{name} imported by a torch-free command (blocked by the test)")
        return None

sys.meta_path.insert(0, NoTorch())


def _done(code):
    sys.stdout.flush()
    leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    if attempts or leaked:
        print(f"GUARD: torch-free path tried to import {BLOCKED}: {leaked}\n" + "\n".join(attempts),
              file=sys.stderr)
        sys.stderr.flush()
        os._exit(%d)
    sys.exit(code)
''' % GUARD_EXIT


def _run(body: str) -> subprocess.CompletedProcess:
    code = _GUARD + "\ntry:\n" + "".join(f"    {line}\n" for line in body.strip().splitlines()) + \
        "except SystemExit as exc:\n    _done(exc.code)\n" \
        "except BaseException:\n    traceback.print_exc()\n    _done(1)\n_done(0)\n"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})


def _cli(*args: str) -> subprocess.CompletedProcess:
    """`python -m harness.cli ARGS` under the guard."""
    return _run(f"import runpy\nsys.argv = ['harness', *{list(args)!r}]\n"
                "runpy.run_module('harness.cli', run_name='__main__', alter_sys=True)")


def test_the_guard_fails_loudly_when_torch_is_imported_even_if_the_error_is_swallowed():
    r = _run("try:\n    import torch\nexcept ImportError:\n    pass")
    assert r.returncode == GUARD_EXIT, (r.returncode, r.stderr)
    assert "tried to import" in r.stderr and "import of torch" in r.stderr


def test_the_memory_model_imports_no_torch():
    r = _run("import harness.checks.memory_model, harness.layouts, harness.models, harness.spec, harness.errors\n"
             "import harness.cli")
    assert r.returncode == 0, r.stderr


def test_project_memory_runs_without_torch_and_prints_the_projection():
    model_name, layout_id, per_node = "70b", "tp8-pp2-cp1-dp16", 8
    r = _cli("project-memory", "--model", model_name, "--layout", layout_id, "--ranks-per-node", str(per_node))
    assert r.returncode == 0, (r.returncode, r.stderr)
    lines = r.stdout.splitlines()
    model = load_model(model_name)
    layout = validate(Layout.parse(layout_id), model)
    assert lines[0] == f"model 70b ({model.num_params() / 1e9:.2f}B params), layout {layout_id}, 8 ranks per node"
    gib = 1024 * MIB
    formats = ("dp_reshardable", "fully_reshardable", "fully_reshardable_mem_efficient")
    for fmt in formats:
        p = project(fmt, model, layout, per_node)
        line = next(x for x in lines if x.split()[0] == fmt)
        assert f"(worst: rank {p.worst_rank})" in line, line
        assert f"{p.per_rank_low / gib:8.1f} - {p.per_rank_high / gib:8.1f} GiB" in line, line
        assert f"per node up to {p.per_node_high / gib:9.1f} GiB" in line, line
    # the figures are figures: 70B parameters of Adam state do not fit in a few GiB per node
    assert project("fully_reshardable", model, layout, per_node).per_node_high > 100 * gib


def test_project_memory_bad_input_without_torch_is_one_line_and_exit_2():
    r = _cli("project-memory", "--model", "70b", "--layout", "tp8-pp2-cp1-dp16", "--format", "nope")
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.strip().startswith("harness: error: --format 'nope': no memory model for it"), r.stderr
