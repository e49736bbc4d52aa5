"""Sessions: tests, cpu-suite (CPU ranks, gloo), gpu-suite (NCCL, one rank per GPU), nightly, baselines, bisect."""

from __future__ import annotations

import os
import shutil

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


# Step times in the cpu-suite are judged against baselines recorded on another machine of the CPU kind:
# its speed relative to the recording machine is not measured, while the run-to-run drift on one machine
# reached +14% (README, "Step performance"). 50% keeps CI free of false alarms and still fails a step
# that got much slower; the exact counters (FLOPs, collectives, overlap) are judged exactly everywhere.
CPU_SUITE_MIN_EFFECT = "0.5"


@nox.session(name="cpu-suite")
def cpu_suite(session: nox.Session) -> None:
    """The regression suites on CPU ranks (gloo), world size 4 by default."""
    _install_cpu(session)
    session.run("pytest", "suites", "-m", "cpu and not nightly", "--backend", "gloo",
                "--world-size", os.environ.get("HARNESS_WORLD_SIZE", "4"), "--min-effect", CPU_SUITE_MIN_EFFECT,
                *session.posargs)


@nox.session(name="gpu-suite", venv_params=["--system-site-packages"])
def gpu_suite(session: nox.Session) -> None:
    """The suites on this node's GPUs (NCCL, one rank per GPU), reusing the node's torch and TE."""
    session.install("-e", ".[test]")  # torch / TE already in the system site packages are kept
    world = session.posargs[0] if session.posargs and session.posargs[0].isdigit() else None
    extra = session.posargs[1:] if world else session.posargs
    session.run("pytest", "suites", "-m", "not nightly", "--backend", "nccl",
                *(["--world-size", world] if world else []), *extra)


@nox.session(venv_params=["--system-site-packages"])
def nightly(session: nox.Session) -> None:
    """Every suite x models x construction paths on this node (GPUs if any, else 4 CPU ranks), then the
    report (Markdown, JUnit, PNGs) in nightly-out/. Arguments after -- go to `harness nightly`."""
    if shutil.which("nvidia-smi"):
        session.install("-e", ".[test]")  # the node's torch / TE from the system site packages
    else:
        _install_cpu(session)
    args = session.posargs if any(a.startswith("--out") for a in session.posargs) else ["--out", "nightly-out", *session.posargs]
    session.run("harness", "nightly", *args)


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
