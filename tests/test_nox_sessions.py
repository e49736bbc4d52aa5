"""The GPU nox sessions set themselves up on the environment nox is run from (a node's torch virtualenv or
conda env), downloading nothing it already has; here on CPU, with the package index unreachable."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BASE_PYTHON = os.path.join(sys.base_prefix, "bin", "python3")
# Any download would go here and fail: what the session needs must come from the environment.
OFFLINE = {"PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_EXTRA_INDEX_URL": "", "PIP_FIND_LINKS": "",
           "PIP_RETRIES": "0", "PIP_TIMEOUT": "2", "VIRTUALENV_NO_PERIODIC_UPDATE": "1"}

pytestmark = pytest.mark.slow


def _venv(path: Path, sees: list[str]) -> Path:
    """A virtualenv of the base interpreter (which has no torch) whose packages are `sees` (a .pth file):
    the shape of a GPU node's environment, whose torch lives in it and not in the base interpreter."""
    subprocess.run([BASE_PYTHON, "-m", "venv", "--without-pip", str(path)], check=True)
    purelib = subprocess.run([str(path / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "node-packages.pth").write_text("".join(f"{p}\n" for p in sees))
    return path


def _nox(python: str, envdir: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([python, "-m", "nox", "-f", str(ROOT / "noxfile.py"), "-s", "gpu-suite", "--install-only",
                           "--envdir", str(envdir)], capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, **OFFLINE, **env})


def test_gpu_suite_uses_the_torch_of_the_virtualenv_nox_runs_from(tmp_path):
    here = sysconfig.get_paths()["purelib"]  # this test environment's packages: torch, megatron-core, nox, ...
    base_has_torch = subprocess.run([BASE_PYTHON, "-c", "import torch"], capture_output=True).returncode == 0
    node = _venv(tmp_path / "node-env", [here])
    proc = _nox(str(node / "bin" / "python"), tmp_path / "nox",
                {"VIRTUAL_ENV": str(node), "PATH": f"{node / 'bin'}{os.pathsep}{os.environ['PATH']}"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    installs = [line for line in out.splitlines() if "pip install" in line]
    assert len(installs) == 1 and "--no-index" in installs[0], installs  # nothing needed an index
    (session_python,) = glob.glob(str(tmp_path / "nox" / "gpu-suite*" / "bin" / "python"))
    torch_file = subprocess.run([session_python, "-c", "import torch; print(torch.__file__)"],
                                capture_output=True, text=True, check=True).stdout.strip()
    assert torch_file.startswith(here), (torch_file, here, base_has_torch)


def test_gpu_suite_refuses_an_environment_without_torch(tmp_path):
    bare = _venv(tmp_path / "bare-env", [])
    proc = _nox(sys.executable, tmp_path / "nox", {"HARNESS_NODE_PYTHON": str(bare / "bin" / "python")})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert f"runs on the torch of the environment nox is run from ({bare / 'bin' / 'python'}), which has none" in out, \
        out[-3000:]
    assert not [line for line in out.splitlines() if "pip install" in line]


def test_a_stack_without_its_python_fails_saying_how_to_get_one(tmp_path):
    """pyenv's python3.12 shim refuses to run until 3.12 is selected; with no installed 3.12 for the session to find,
    the current stack's session fails (never skips green) and names the ways to get one."""
    # a virtualenv's bin on PATH (the one the tests run from, under nox) holds a python3.12 the session would use
    path = [d for d in os.environ.get("PATH", "").split(os.pathsep) if not (Path(d).parent / "pyvenv.cfg").exists()]
    env = {**os.environ, "PYENV_ROOT": str(tmp_path / "no-pyenv"), "PYENV_VERSION": "3.11.7",
           "HARNESS_PYTHON_3_12": "", "PATH": os.pathsep.join(path)}
    env.pop("HARNESS_PYTHON_3_12")
    if any(os.path.exists(p) for p in ("/usr/bin/python3.12", "/usr/local/bin/python3.12")):
        pytest.skip("this machine has a system python3.12, which the session finds")
    proc = subprocess.run([sys.executable, "-m", "nox", "-f", str(ROOT / "noxfile.py"), "-s", "unit", "--install-only",
                           "--envdir", str(tmp_path / "nox")], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "no runnable Python 3.12 here, which the current stack (megatron-core 0.19.2) needs" in out, out[-3000:]
    assert "HARNESS_PYTHON_3_12=/path/to/python3.12" in out and "pyenv install 3.12" in out
