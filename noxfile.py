"""Sessions: tests, unit, lint, cpu-suite (CPU ranks, gloo), gpu-suite (NCCL, one rank per GPU), nightly, baselines,
bisect, flakes.

Two tested stacks (harness/stack.py): the current one (Python 3.12, megatron-core 0.19.2, megatron-bridge 0.6.2) runs
by default; every CPU session has a twin on the previous stack (Python 3.11, megatron-core 0.16.1, megatron-bridge
0.3.1) named `<session>-previous`. Each stack has one virtualenv (.nox/stack-<name>) that its sessions share, set
up again only when what it installs changes."""

from __future__ import annotations

import fcntl
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import nox

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from harness.stack import CURRENT, PREVIOUS, TestedStack  # noqa: E402 - the tested pairs, declared once

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = True  # a stack without its Python fails, never skips green

CPU_CONSTRAINTS = "constraints-cpu.txt"  # torch==2.13.0: on Python 3.11 the CPU build on this disk


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


# -- the stacks' virtualenvs ---------------------------------------------------------------------------------
def _python_version(python: str) -> str | None:
    """'3.12' for an interpreter that runs; None for one that does not (pyenv's shim of a version not selected)."""
    try:
        proc = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def find_python(version: str) -> str | None:
    """A runnable interpreter of `version` (major.minor): $HARNESS_PYTHON_<3_12>, python<3.12> on PATH, pyenv's
    installed versions (its shim on PATH refuses a version not selected), the system's."""
    named = os.environ.get(f"HARNESS_PYTHON_{version.replace('.', '_')}")
    if named:
        return named if _python_version(named) == version else None
    root = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    candidates = [shutil.which(f"python{version}"),
                  *sorted(glob.glob(os.path.join(root, "versions", f"{version}.*", "bin", f"python{version}")),
                          reverse=True),
                  f"/usr/bin/python{version}", f"/usr/local/bin/python{version}"]
    return next((c for c in candidates if c and os.path.exists(c) and _python_version(c) == version), None)


def _no_python(stack: TestedStack) -> str:
    var = f"HARNESS_PYTHON_{stack.python.replace('.', '_')}"
    return (f"no runnable Python {stack.python} here, which the {stack.name} stack (megatron-core "
            f"{stack.megatron_core}) needs: install one (pyenv: `pyenv install {stack.python}`; where pyenv has it, "
            f"its python{stack.python} shim runs once selected, e.g. `pyenv global 3.11.7 3.12.1`), or name it with "
            f"{var}=/path/to/python{stack.python}")


def _requirements(*extras: str) -> list[str]:
    """The harness's dependencies and those of the given extras, from pyproject.toml."""
    with open(os.path.join(HERE, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    return [*project["dependencies"], *(r for e in extras for r in project["optional-dependencies"][e])]


def _pins(stack: TestedStack) -> list[str]:
    return [f"torch=={stack.torch}", f"megatron-core=={stack.megatron_core}", f"mbridge=={stack.mbridge}", *stack.pins]


def stack_env(session: nox.Session, stack: TestedStack, linters: bool = False) -> str:
    """The bin directory of the stack's shared virtualenv (.nox/stack-<name>), made or brought up to date: torch,
    the harness (editable) with its test and bridge extras at the stack's releases, megatron-bridge --no-deps (its
    wheel pins CUDA-only packages; the harness imports it behind a scoped stub: harness/engines/megatron_bridge.py)."""
    python = find_python(stack.python)
    if python is None:
        session.error(_no_python(stack))
    venv = Path(os.fspath(session._runner.global_config.envdir), f"stack-{stack.name}").resolve()  # nox's --envdir
    want = {"python": _python_version(python), "interpreter": os.path.realpath(python), "pins": _pins(stack),
            "bridge": stack.megatron_bridge, "requirements": _requirements("test", "mbridge", "bridge"),
            "constraints": Path(HERE, CPU_CONSTRAINTS).read_text(), "linters": list(LINTERS) if linters else []}
    stamp = venv / ".harness-stack.json"
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f"stack-{stack.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another nox run setting up the same stack waits its turn
        try:
            have = json.loads(stamp.read_text()) if stamp.exists() else {}
        except ValueError:
            have = {}
        python_there = (venv / "bin" / "python").exists()
        if python_there and all(have.get(k) == v for k, v in want.items() if v):  # linters, once there, stay
            return str(venv / "bin")
        if not python_there or have.get("interpreter") != want["interpreter"]:
            shutil.rmtree(venv, ignore_errors=True)
            have = {}
            session.run_install(python, "-m", "venv", str(venv), external=True, silent=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        session.run_install(*pip, "-c", CPU_CONSTRAINTS, f"torch=={stack.torch}", external=True)
        session.run_install(*pip, "-c", CPU_CONSTRAINTS, "-e", ".[test,mbridge,bridge]", *_pins(stack)[1:],
                            external=True)
        session.run_install(*pip, "--no-deps", f"megatron-bridge=={stack.megatron_bridge}", external=True)
        if linters:
            session.run_install(*pip, *LINTERS, external=True)
        done = {**want, "linters": want["linters"] or have.get("linters") or []}
        tmp = stamp.with_suffix(".tmp")
        tmp.write_text(json.dumps(done, indent=1))
        os.replace(tmp, stamp)  # written whole, after every install succeeded
    return str(venv / "bin")


def run_in(session: nox.Session, bindir: str, *args: str, **kwargs) -> None:
    """A command of the stack's virtualenv (its bin first on PATH, as an activated environment)."""
    env = {"PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}", "VIRTUAL_ENV": os.path.dirname(bindir),
           **kwargs.pop("env", {})}
    session.run(os.path.join(bindir, args[0]), *args[1:], external=True, env=env, **kwargs)


LINTERS = ("ruff==0.17.6", "mypy==2.4.1", "types-tabulate", "types-psutil")
TEST_WORKERS = "2"  # pytest-xdist workers: the ranks of one test leave a 2-core machine idle ~40% of the time
STACKS = {"": CURRENT, "-previous": PREVIOUS}


@nox.session(venv_backend="none")
def lint(session: nox.Session) -> None:
    """ruff and mypy on harness/ (configured in pyproject.toml), against the current stack's packages."""
    bindir = stack_env(session, CURRENT, linters=True)
    run_in(session, bindir, "ruff", "check", "harness")
    run_in(session, bindir, "mypy")


def _tests(session: nox.Session, stack: TestedStack) -> None:
    bindir = stack_env(session, stack)
    run_in(session, bindir, "pytest", "tests", "-m", "not nightly", "-n", TEST_WORKERS, "--dist", "loadscope",
           *session.posargs)


def _unit(session: nox.Session, stack: TestedStack) -> None:
    bindir = stack_env(session, stack)
    run_in(session, bindir, "pytest", "tests", "-m", "not slow and not nightly", "-n", TEST_WORKERS,
           *session.posargs)


def _cpu_suite(session: nox.Session, stack: TestedStack) -> None:
    bindir = stack_env(session, stack)
    # two suites at a time, as the tests run: step-perf's runs hold the machine alone (harness/launch/machine_lock.py)
    run_in(session, bindir, "pytest", "suites", "-m", "cpu and not nightly", "--backend", "gloo",
           "--world-size", os.environ.get("HARNESS_WORLD_SIZE", "4"), "-n", TEST_WORKERS, "--dist", "loadscope",
           *session.posargs)


FLAKE_TESTS = ("tests/test_rendezvous.py", "tests/test_zygote.py", "tests/test_pool.py", "tests/test_runner.py")


def _flakes(session: nox.Session, stack: TestedStack) -> None:
    bindir = stack_env(session, stack)
    if session._runner.global_config.install_only:
        return
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
                code = subprocess.run([os.path.join(bindir, "pytest"), "-q", *args], stdout=f,
                                      stderr=subprocess.STDOUT).returncode
            session.log(f"round {r}/{rounds}: {'pass' if code == 0 else f'FAILED (exit {code}, {log})'}")
            if code != 0:
                failed.append(log)
    finally:
        load.kill()
    if failed:
        session.error(f"{len(failed)} of {rounds} rounds failed: {', '.join(failed)}")
    session.log(f"{rounds} of {rounds} rounds passed beside a one-core load")


def _baselines(session: nox.Session, stack: TestedStack) -> None:
    bindir = stack_env(session, stack)
    args = session.posargs or ["--suite", "ckpt-memory", "--model", "small", "--world-size", "4"]
    run_in(session, bindir, "harness", "baselines", "record", *args)


def _bisect(session: nox.Session, stack: TestedStack) -> None:
    if not session.posargs:
        session.error("give the bisect after --, e.g. nox -s bisect -- --megatron-core 0.16.1..0.19.2 "
                      "--suite rl-cycle --layout tp1-pp1-cp1-dp4-ep2 --metric fail")
    bindir = stack_env(session, stack)
    run_in(session, bindir, "harness", "bisect", *session.posargs)


# Each session once per stack: `tests` on the current stack, `tests-previous` on the previous one.
SESSIONS = {
    "tests": (_tests, "The harness's own tests on CPU (unit tests + fault injection on real gloo ranks), on two "
                      "pytest-xdist workers (a module stays on one), the nightly tier left out; `-- -n 0` runs them "
                      "in one process."),
    "unit": (_unit, "The unit tier of the harness's own tests: no rank process (pytest -m \"not slow and not "
                    "nightly\")."),
    "cpu-suite": (_cpu_suite, "The regression suites on CPU ranks (gloo), world size 4 by default."),
    "flakes": (_flakes, "Hunt a flaky test: pytest ROUNDS times in a row beside a CPU-bound process on one core, "
                        "counting the rounds that failed; each round's log is in .flakes/. `-- ROUNDS [pytest args]` "
                        "(default: 5 rounds of the rank-start tests: rendezvous, fork server, pool, runner)."),
    "baselines": (_baselines, "Record baselines (3 repeats; atomic write; prints the diff; refuses noisy metrics). "
                              "Arguments after -- replace the default (-- --suite ckpt-memory --model small)."),
    "bisect": (_bisect, "`harness bisect` with the arguments after -- (megatron-core releases layered over the "
                        "stack's environment, or commits of a checkout)."),
}


def _register(name: str, body, doc: str, suffix: str, stack: TestedStack) -> None:
    def session_fn(session: nox.Session) -> None:
        body(session, stack)

    session_fn.__doc__ = (f"{doc} [{stack.name} stack: Python {stack.python}, megatron-core {stack.megatron_core}, "
                          f"megatron-bridge {stack.megatron_bridge}]")
    nox.session(session_fn, name=name + suffix, venv_backend="none", default=name == "tests" and not suffix)


for _name, (_body, _doc) in SESSIONS.items():
    for _suffix, _stack in STACKS.items():
        _register(_name, _body, _doc, _suffix, _stack)


@nox.session(name="gpu-suite", python=NODE_PYTHON)
def gpu_suite(session: nox.Session) -> None:
    """The suites on this node's GPUs (NCCL, one rank per GPU), on the torch / TE of the environment nox runs
    from. `-- N` sets the world size (default: every GPU); more arguments go to pytest."""
    _use_node_environment(session)
    world = session.posargs[0] if session.posargs and session.posargs[0].isdigit() else None
    extra = session.posargs[1:] if world else session.posargs
    session.run("python", "-m", "pytest", "suites", "-m", "not nightly", "--backend", "nccl",
                "--world-size", world or str(max(1, _gpus())), *extra, env={"PYTHONPATH": HERE})


@nox.session(python=NODE_PYTHON if _gpus() else None, venv_backend=None if _gpus() else "none")
def nightly(session: nox.Session) -> None:
    """Every suite x models x construction paths on this node, then the report (the HTML page, Markdown, JUnit, PNGs)
    and the history's site (nightly-out/site/index.html) in nightly-out/: on GPUs on the environment nox runs from; else on 4 CPU ranks on both tested stacks, each into
    nightly-out/<stack>/. Arguments after -- go to `harness nightly`."""
    given = any(a.startswith("--out") for a in session.posargs)
    args = session.posargs if given else ["--out", "nightly-out", *session.posargs]
    if _gpus():
        _use_node_environment(session)
        session.run("python", "-m", "harness.cli", "nightly", *args, env={"PYTHONPATH": HERE})
        return
    previous, current = stack_env(session, PREVIOUS), stack_env(session, CURRENT)
    # the tests' nightly tier (sweeps over every shipped model and world size), then every suite on both stacks;
    # a failure of the first does not keep the second (and its history) from running
    try:
        run_in(session, current, "pytest", "tests", "-m", "nightly", "-n", TEST_WORKERS, "--dist", "loadscope")
        tests_failed = False
    except nox.command.CommandFailed:
        tests_failed = True
    run_in(session, current, "harness", "nightly", *args, "--other-stack",
           f"previous={os.path.join(previous, 'python')}")
    if tests_failed:
        session.error("the tests' nightly tier failed (above); the suites' nightly ran")


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
