"""`pytest tests --phase-table FILE`: where the tests' time goes, per test module - its tests' wall (pytest's setup,
call and teardown) and, of the suite runs it made, the harness's own phase timers (harness/report/time_spent.py:
rank start, imports, build, steps, other phases, judging). Under pytest-xdist each worker writes its runs beside FILE
and the controller writes the table (Markdown) at the end: `nox -s tests -- --phase-table phases.md`."""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--phase-table", default=None, metavar="FILE",
                     help="write where the time went per test module (Markdown) to FILE")


def _parts(config: pytest.Config) -> Path:
    return Path(config.getoption("--phase-table") + ".parts")


def _worker(config: pytest.Config) -> str:
    return getattr(config, "workerinput", {}).get("workerid", "main")


_CONFIG: list[pytest.Config] = []  # this process's config (pytest_runtest_logreport is not handed it)


def pytest_configure(config: pytest.Config) -> None:
    if not config.getoption("--phase-table"):
        return
    _CONFIG.append(config)
    if not hasattr(config, "workerinput") and _parts(config).exists():  # an aborted run's parts: not this run's
        for part in _parts(config).glob("*.jsonl"):
            part.unlink()
    _parts(config).mkdir(parents=True, exist_ok=True)
    from harness import driver

    execute = driver.execute
    sink = _parts(config) / f"{_worker(config)}.runs.jsonl"

    def recording(*args, **kwargs):
        run = execute(*args, **kwargs)
        module = os.environ.get("PYTEST_CURRENT_TEST", "?").split("::")[0]
        data = {"module": module, "wall_s": run.wall_s, "judge_s": run.judge_s,
                "cases": [{"wall_s": r.wall_s, "timings": r.timings()} for r in run.results]}
        with sink.open("a") as f:
            f.write(json.dumps(data) + "\n")
        return run

    driver.execute = recording


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Every test's phases, recorded once: by the controller, which hears every worker's reports (or the only
    process, without workers)."""
    if not _CONFIG or hasattr(_CONFIG[0], "workerinput"):
        return
    with (_parts(_CONFIG[0]) / "tests.jsonl").open("a") as f:
        f.write(json.dumps({"module": report.nodeid.split("::")[0], "duration": report.duration}) + "\n")


def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    if not config.getoption("--phase-table") or hasattr(config, "workerinput"):
        return  # the controller (or a run without workers) writes the table
    from harness.report import time_spent
    from harness.tables import markdown_table

    runs: dict[str, list] = defaultdict(list)
    walls: dict[str, float] = defaultdict(float)
    for part in sorted(_parts(config).glob("*.jsonl")):
        for line in part.read_text().splitlines():
            d = json.loads(line)
            if part.name.endswith(".runs.jsonl"):
                runs[d["module"]].append(d)
            else:
                walls[d["module"]] += d["duration"]
    rows = time_spent.rows(sorted(runs.items(), key=lambda kv: -walls[kv[0]]))
    by_module = {r[0]: r for r in rows}
    table = []
    for module, wall in sorted(walls.items(), key=lambda kv: -kv[1]):
        row = by_module.get(module, [module, "0", "0", "0", *("-" for _ in time_spent.COLUMNS)])
        table.append([module, f"{wall:.0f}", *row[1:]])
    out = Path(config.getoption("--phase-table"))
    out.write_text(f"tests' wall (setup + call + teardown) {sum(walls.values()):.0f} s over {len(walls)} modules\n\n"
                   + markdown_table(["module", "tests s", *time_spent.HEADERS[1:]], table) + "\n")
    for part in _parts(config).glob("*.jsonl"):
        part.unlink()
    _parts(config).rmdir()
