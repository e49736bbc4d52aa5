"""pytest options of the regression suites: --world-size, --backend, --model, --results-dir, baselines."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("harness")
    g.addoption("--world-size", type=int, default=4, help="ranks per case (default 4)")
    g.addoption("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    g.addoption("--model", default=None, help="model spec (default: each suite's CPU model)")
    g.addoption("--engine", default="mcore", help="mcore or package.module:factory")
    g.addoption("--results-dir", default=None, help="write <suite>/results.json per suite here")
    g.addoption("--baselines-dir", default="baselines", help="baseline files (<platform>/<suite>.json)")
    g.addoption("--update-baselines", action="store_true", help="record baselines instead of comparing")
    g.addoption("--fresh-ranks", action="store_true", help="new rank processes per case (no warm pool)")


def pytest_configure(config: pytest.Config) -> None:
    for marker in ("cpu: runs on CPU ranks (gloo)", "gpu: needs GPUs (NCCL)",
                   "slow: starts ranks", "nightly: full matrix, nightly only"):
        config.addinivalue_line("markers", marker)


@pytest.fixture(scope="session")
def harness_opts(request: pytest.FixtureRequest) -> dict:
    c = request.config
    return {
        "world_size": c.getoption("--world-size"), "backend": c.getoption("--backend"),
        "model": c.getoption("--model"), "engine": c.getoption("--engine"),
        "results_dir": c.getoption("--results-dir"), "fresh_ranks": c.getoption("--fresh-ranks"),
    }


_REPORTS = pytest.StashKey[list]()


@pytest.fixture(scope="session")
def publish(request: pytest.FixtureRequest):
    """Suites hand their formatted tables here; they are printed in pytest's terminal summary."""
    reports = request.config.stash.setdefault(_REPORTS, [])
    return reports.append


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    for text in config.stash.get(_REPORTS, []):
        terminalreporter.write_sep("=", "harness report")
        terminalreporter.write_line(text)
