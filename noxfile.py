"""Sessions: tests, lint, cpu-suite (CPU ranks, gloo), gpu-suite (NCCL, one rank per GPU), nightly, baselines, bisect."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib

import nox

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True

CPU_CONSTRAINTS = "constraints-cpu.txt"  # the CPU build of torch; an unpinned torch pulls GBs of CUDA wheels
HERE = os.path.dirname(os.path.abspath(__file__))


def _node_python() -> str:
    """The interpreter of the environment nox is run from, whose torch (and Transformer Engine) the GPU
    sessions use: $HARNESS_NODE_PYTHON, else the active virtualenv's or conda env's python (VIRTUAL_ENV,
    CONDA_PREFIX), else the python3 on PATH, else nox's own."""
    if os.environ.get("HARNESS_NODE_PYTHON"):
        return os.environ["HARNESS_NODE_PYTHON"]
    for var in ("VIRTUAL_ENV", "CONDA_PREFIX"):
        candidate = os.path.join(os.environ.get(var) or "", "bin", "python")
        if os.environ.get(var) and os.path.exists(candidate):
            return candidate
    return shutil.which("python3") or sys.executable


NODE_PYTHON = _node_python()


def _gpus() -> int:
    """NVIDIA devices this node shows (device files, as CUDA_VISIBLE_DEVICES narrows them), without torch."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([v for v in visible.split(",") if v.strip()])
    return len([d for d in glob.glob("/dev/nvidia*") if re.fullmatch(r"/dev/nvidia\d+", d)])


def _install_cpu(session: nox.Session, extras: str = "test,mbridge,bridge") -> None:
    session.install("-c", CPU_CONSTRAINTS, "torch==2.13.0")
    session.install("-c", CPU_CONSTRAINTS, "-e", f".[{extras}]")
    # megatron-bridge's wheel pins CUDA-only packages; the harness imports it behind a scoped stub.
    session.install("--no-deps", "megatron-bridge==0.3.1")


LINTERS = ("ruff==0.17.6", "mypy==2.4.1", "types-tabulate", "types-psutil")


@nox.session
def lint(session: nox.Session) -> None:
    """ruff and mypy on harness/ (configured in pyproject.toml), against the packages the tests run with."""
    _install_cpu(session)
    session.install(*LINTERS)
    session.run("ruff", "check", "harness")
    session.run("mypy")


TEST_WORKERS = "2"  # pytest-xdist workers: the ranks of one test leave a 2-core machine idle ~40% of the time


@nox.session
def tests(session: nox.Session) -> None:
    """The harness's own tests on CPU (unit tests + fault injection on real gloo ranks), on two pytest-xdist
    workers (a module stays on one); `-- -n 0` runs them in one process."""
    _install_cpu(session)
    session.run("pytest", "tests", "-n", TEST_WORKERS, "--dist", "loadscope", *session.posargs)


@nox.session
def unit(session: nox.Session) -> None:
    """The unit tier of the harness's own tests: no rank process (pytest -m "not slow"); under a minute of pytest
    on 2 cores. `nox -s tests` runs it with the rank tests."""
    _install_cpu(session)
    session.run("pytest", "tests", "-m", "not slow", "-n", TEST_WORKERS, *session.posargs)


FLAKE_TESTS = ("tests/test_rendezvous.py", "tests/test_zygote.py", "tests/test_pool.py", "tests/test_runner.py")


@nox.session
def flakes(session: nox.Session) -> None:
    """Hunt a flaky test: pytest ROUNDS times in a row beside a CPU-bound process on one core (as a shared CI
    runner is), counting the rounds that failed; each round's log is in .flakes/. `-- ROUNDS [pytest args]`
    (default: 5 rounds of the rank-start tests: rendezvous, fork server, pool, runner, on two workers)."""
    _install_cpu(session)
    rounds = int(session.posargs[0]) if session.posargs and session.posargs[0].isdigit() else 5
    args = session.posargs[1:] if session.posargs and session.posargs[0].isdigit() else session.posargs
    args = args or [*FLAKE_TESTS, "-n", TEST_WORKERS, "--dist", "loadscope"]
    os.makedirs(".flakes", exist_ok=True)
    load = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    failed = []
    try:
        for r in range(1, rounds + 1):
            log = os.path.join(".flakes", f"round{r}.log")
            with open(log, "w") as f:
                code = subprocess.run([os.path.join(session.bin, "pytest"), "-q", *args], stdout=f,
                                      stderr=subprocess.STDOUT).returncode
            session.log(f"round {r}/{rounds}: {'pass' if code == 0 else f'FAILED (exit {code}, {log})'}")
            if code != 0:
                failed.append(log)
    finally:
        load.kill()
    if failed:
        session.error(f"{len(failed)} of {rounds} rounds failed: {', '.join(failed)}")
    session.log(f"{rounds} of {rounds} rounds passed beside a one-core load")


@nox.session(name="cpu-suite")
def cpu_suite(session: nox.Session) -> None:
    """The regression suites on CPU ranks (gloo), world size 4 by default."""
    _install_cpu(session)
    session.run("pytest", "suites", "-m", "cpu and not nightly", "--backend", "gloo",
                "--world-size", os.environ.get("HARNESS_WORLD_SIZE", "4"), *session.posargs)



@nox.session(name="gpu-suite", python=NODE_PYTHON)
def gpu_suite(session: nox.Session) -> None:
    """The suites on this node's GPUs (NCCL, one rank per GPU), on the torch / TE of the environment nox runs
    from. `-- N` sets the world size (default: every GPU); more arguments go to pytest."""
    _use_node_environment(session)
    world = session.posargs[0] if session.posargs and session.posargs[0].isdigit() else None
    extra = session.posargs[1:] if world else session.posargs
    session.run("python", "-m", "pytest", "suites", "-m", "not nightly", "--backend", "nccl",
                "--world-size", world or str(max(1, _gpus())), *extra, env={"PYTHONPATH": HERE})


@nox.session(python=NODE_PYTHON if _gpus() else None)
def nightly(session: nox.Session) -> None:
    """Every suite x models x construction paths on this node (GPUs if any, on the environment nox runs from;
    else 4 CPU ranks), then the report (Markdown, JUnit, PNGs) in nightly-out/. Arguments after -- go to
    `harness nightly`."""
    if _gpus():
        _use_node_environment(session)
    else:
        _install_cpu(session)
    args = session.posargs if any(a.startswith("--out") for a in session.posargs) else ["--out", "nightly-out", *session.posargs]
    session.run("python", "-m", "harness.cli", "nightly", *args, env={"PYTHONPATH": HERE})


# What the node environment's python puts on sys.path beyond the standard library: its site-packages,
# what its .pth files add (editable installs, a conda env's extra dirs), its base's when it has them.
_SITE_DIRS = """
import json, os, sys, sysconfig
std = {sysconfig.get_path("stdlib"), sysconfig.get_path("platstdlib")}
print(json.dumps({"version": list(sys.version_info[:2]), "executable": sys.executable,
                  "paths": [p for p in sys.path if p and os.path.isdir(p) and p not in std
                            and not p.endswith("lib-dynload")]}))
"""


def _use_node_environment(session: nox.Session) -> None:
    """Make the packages of the environment nox runs from (NODE_PYTHON: the active virtualenv or conda env,
    else python3) importable in the session's virtualenv through a .pth file, and install only what it lacks
    of the harness's requirements; the harness itself runs from this checkout (PYTHONPATH).

    A virtualenv made with --system-site-packages from a virtualenv's or conda env's python sees the *base*
    interpreter's packages, not that environment's: on a node whose torch lives in a virtualenv, pip then went
    to fetch another torch (no network there). Here nothing is downloaded when the environment has everything
    (pip checks with --no-index first), what is missing comes from $HARNESS_WHEELS when set (a node without
    network), and torch is never installed: an environment without torch is refused."""
    node = json.loads(subprocess.run([NODE_PYTHON, "-c", _SITE_DIRS], capture_output=True, text=True,
                                     check=True).stdout)
    venv_python = os.path.join(session.bin, "python")
    probe = subprocess.run([venv_python, "-c", "import json, sys, sysconfig; print(json.dumps("
                            "[list(sys.version_info[:2]), sysconfig.get_paths()['purelib']]))"],
                           capture_output=True, text=True, check=True)
    version, purelib = json.loads(probe.stdout)
    if version != node["version"]:
        session.error(f"the session's Python is {'.'.join(map(str, version))} but the node's environment "
                      f"({node['executable']}) is {'.'.join(map(str, node['version']))}: set HARNESS_NODE_PYTHON "
                      f"to that interpreter, or run `{node['executable']} -m nox -s {session.name}`")
    with open(os.path.join(purelib, "harness-node-environment.pth"), "w") as f:
        f.write("\n".join(node["paths"]) + "\n")
    if subprocess.run([venv_python, "-c", "import torch"], capture_output=True).returncode != 0:
        session.error(f"{session.name} runs on the torch of the environment nox is run from ({node['executable']}), "
                      f"which has none: activate the node's environment or set HARNESS_NODE_PYTHON to its python "
                      f"(CPU ranks: nox -s cpu-suite)")
    requirements = _requirements("test")
    try:  # everything there already: pip looks at no index and installs nothing
        session.install("--no-index", *requirements, silent=True)
        return
    except nox.command.CommandFailed:
        pass
    wheels = os.environ.get("HARNESS_WHEELS")
    if wheels:
        session.install("--no-index", "--find-links", wheels, *requirements)
    else:
        session.install(*requirements)


def _requirements(*extras: str) -> list[str]:
    """The harness's dependencies and those of the given extras, from pyproject.toml."""
    with open(os.path.join(HERE, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    return [*project["dependencies"], *(r for e in extras for r in project["optional-dependencies"][e])]


@nox.session
def baselines(session: nox.Session) -> None:
    """Record baselines (3 repeats; atomic write; prints the diff; refuses noisy metrics).
    Arguments after -- replace the default (e.g. -- --suite ckpt-memory --layout tp1-pp1-cp1-dp4)."""
    _install_cpu(session)
    args = session.posargs or ["--suite", "ckpt-memory", "--model", "small", "--world-size", "4"]
    session.run("harness", "baselines", "record", *args)


@nox.session
def bisect(session: nox.Session) -> None:
    """`harness bisect` with the arguments after -- (versions in cached virtualenvs, or commits of a checkout)."""
    if not session.posargs:
        session.error("give the bisect after --, e.g. nox -s bisect -- --megatron-core 0.15.0..0.16.1 --find-fix "
                      "--suite ckpt-memory --layout tp1-pp1-cp1-dp4 --ckpt-format dp_reshardable --metric fail --error-is-bad")
    _install_cpu(session)
    session.run("harness", "bisect", *session.posargs)
