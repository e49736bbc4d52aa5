"""A CPU rank imports megatron-core without building torch.compile's wrappers: each function megatron decorates
is compiled, by the real torch.compile with its options, at its first call."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from harness.launch.rank_imports import deferred_compile


def test_a_function_compiled_while_importing_is_compiled_at_its_first_call(monkeypatch):
    compiles = []

    def real(model, **options):
        compiles.append((model, options))
        return lambda *args: ("compiled", model(*args))

    monkeypatch.setattr(torch, "compile", real)

    def add_one(x):
        return x + 1

    class Module:
        def __call__(self, x):
            return x

    module = Module()
    with deferred_compile():
        direct = torch.compile(add_one, mode="max-autotune")
        decorated = torch.compile(dynamic=True)(add_one)
        torch.compile(module)  # not a function: compiled at once
    assert torch.compile is real
    assert compiles == [(module, {})]
    assert direct.__name__ == "add_one" and direct(1) == ("compiled", 2) and direct(2) == ("compiled", 3)
    assert decorated(5) == ("compiled", 6)
    assert compiles[1:] == [(add_one, {"mode": "max-autotune"}), (add_one, {"dynamic": True})]  # once each


@pytest.mark.slow  # starts an interpreter that imports torch and megatron (seconds each)
def test_a_cpu_rank_imports_megatron_without_inductor():
    script = """
import sys, torch
real = torch.compile
from harness.launch.rank_imports import MEGATRON, import_modules
import_modules(MEGATRON, on_cpu=True, optional=True)
import megatron.core.jit
assert torch.compile is real
print(sorted(m for m in sys.modules if m.startswith("torch._inductor.compile_fx")))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]", "megatron-core's torch.compile decorations imported inductor on a CPU rank"
