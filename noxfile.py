"""Sessions: tests, cpu-suite (CPU ranks, gloo), gpu-suite (NCCL, one rank per GPU)."""

from __future__ import annotations

import os

import nox

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True

CPU_CONSTRAINTS = "constraints-cpu.txt"  # the CPU build of torch; an unpinned torch pulls GBs of CUDA wheels


def _install_cpu(session: nox.Session, extras: str = "test,mbridge,bridge") -> None:
    session.install("-c", CPU_CONSTRAINTS, "torch==2.13.0")
    session.install("-c", CPU_CONSTRAINTS, "-e", f".[{extras}]")
    # megatron-bridge's wheel pins CUDA-only packages; the harness imports it behind a scoped stub.
    session.install("--no-deps", "megatron-bridge==0.3.1")


@nox.session
def tests(session: nox.Session) -> None:
    """The harness's own tests on CPU (unit tests + fault injection on real gloo ranks)."""
    _install_cpu(session)
    session.run("pytest", "tests", *session.posargs)


@nox.session(name="cpu-suite")
def cpu_suite(session: nox.Session) -> None:
    """The regression suites on CPU ranks (gloo), world size 4 by default."""
    _install_cpu(session)
    session.run("pytest", "suites", "-m", "cpu and not nightly", "--backend", "gloo",
                "--world-size", os.environ.get("HARNESS_WORLD_SIZE", "4"), *session.posargs)


@nox.session(name="gpu-suite", venv_params=["--system-site-packages"])
def gpu_suite(session: nox.Session) -> None:
    """The suites on this node's GPUs (NCCL, one rank per GPU), reusing the node's torch and TE."""
    session.install("-e", ".[test]")  # torch / TE already in the system site packages are kept
    world = session.posargs[0] if session.posargs and session.posargs[0].isdigit() else None
    extra = session.posargs[1:] if world else session.posargs
    session.run("pytest", "suites", "-m", "not nightly", "--backend", "nccl",
                *(["--world-size", world] if world else []), *extra)


@nox.session
def baselines(session: nox.Session) -> None:
    """Record baselines (3 repeats; atomic write; prints the diff). Arguments after -- replace the default."""
    _install_cpu(session)
    args = session.posargs or ["--suite", "ckpt-memory", "--model", "small", "--world-size", "4"]
    session.run("harness", "baselines", "record", *args)
