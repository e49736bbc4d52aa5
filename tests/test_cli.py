"""The `harness` command: layouts listing, exit codes, results.json, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from harness.cli import main


def test_layouts_lists_every_valid_layout(capsys):
    assert main(["layouts", "--world-size", "8", "--model", "tiny"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 12 and lines[0].startswith("tp1-pp1-cp1-dp8\t")


def test_invalid_layout_is_refused_with_the_reason(capsys):
    assert main(["layouts", "--world-size", "8", "--model", "tiny", "--layout", "tp3-pp1-cp1-dp1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert err.startswith("harness: error: layout tp3-pp1-cp1-dp1 is invalid for model tiny:")
    assert "num_attention_heads=4 not divisible by tp=3" in err


@pytest.mark.parametrize("argv,expected", [
    (["run", "--suite", "equivalence", "--model", "nope", "--world-size", "2"], "unknown model 'nope'"),
    (["run", "--suite", "nope", "--model", "tiny", "--world-size", "2"], "unknown suite 'nope'"),
    (["run", "--suite", "equivalence", "--model", "tiny", "--world-size", "2", "--layout", "tp2-pp2-cp1-dp1"],
     "tp*pp*cp*dp = 4 != world size 2"),
    (["run", "--suite", "equivalence", "--model", "tiny", "--world-size", "2", "--engine", "nosuchpkg.mod:make"],
     "cannot import 'nosuchpkg'"),
    (["run", "--suite", "equivalence", "--model", "tiny", "--world-size", "2", "--backend", "nccl"],
     "backend nccl needs one GPU per rank"),
])
def test_bad_input_exits_2_and_writes_nothing(tmp_path, capsys, argv, expected):
    out = tmp_path / "out"
    assert main([*argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1
    assert not out.exists()


@pytest.mark.slow
def test_run_prints_table_and_writes_results_json(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "harness.cli", "run", "--suite", "equivalence", "--model", "tiny",
         "--world-size", "2", "--layout", "tp2-pp1-cp1-dp1", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "tp2-pp1-cp1-dp1" in proc.stdout and "phase timings" in proc.stdout
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["passed"] and data["platform"] == "cpu-gloo"
    assert [c["layout"] for c in data["cases"]] == ["tp1-pp1-cp1-dp2", "tp2-pp1-cp1-dp1"]
    assert {"imports", "build", "steps"} <= set(data["cases"][0]["timings"])
    assert len(data["cases"][1]["metrics"]["losses"]) == 2


def test_the_parser_imports_nothing_heavy():
    """Every command registers its flags without importing torch, megatron or the driver (fast start)."""
    code = ("import sys, harness.cli as c; c.build_parser().parse_args(['run', '--suite', 'x']); "
            "heavy = sorted(m for m in ('torch', 'megatron', 'numpy', 'harness.driver', 'harness.bisect') "
            "if m in sys.modules); print(heavy)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr


def test_every_command_is_registered_in_order():
    proc = subprocess.run([sys.executable, "-m", "harness.cli", "--help"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0
    assert "{layouts,run,baselines,report,bisect,bisect-step,compare,nightly,history,project-memory,power}" in \
        "".join(proc.stdout.split()), proc.stdout
