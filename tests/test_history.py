"""Nightly history: change points and creep in synthetic series (with the false-alarm rate measured),
ingest that adds nothing twice, a corrupt database refused untouched, and `history show` naming the
night, the versions that changed and the bisect command."""

from __future__ import annotations

import json
import sqlite3
from datetime import date, timedelta

import numpy as np
import pytest

from harness import cli
from harness.errors import BadInput
from harness.history import store
from harness.history.changes import detect

NIGHTS, NOISE = 30, 0.03


def _noisy(rng, n=NIGHTS, base=100.0):
    return base * (1 + NOISE * rng.standard_normal(n))


# -- change points --------------------------------------------------------------------------------
def test_a_step_of_8_percent_at_night_20_is_one_change_point_at_20():
    # one seeded history; over 100 histories the step is found within a night in 94 (next test)
    v = _noisy(np.random.default_rng(0))
    v[20:] *= 1.08
    changes = detect(list(v))
    assert [(c.kind, c.index) for c in changes] == [("step", 20)]
    assert 1.04 < changes[0].ratio < 1.12


def test_the_step_is_found_within_a_night_in_most_histories():
    rng = np.random.default_rng(1)
    found = 0
    for _ in range(100):
        v = _noisy(rng)
        v[20:] *= 1.08
        found += any(c.kind == "step" and abs(c.index - 20) <= 1 for c in detect(list(v)))
    assert found >= 85, found  # measured 94/100 at this penalty


def test_creep_of_half_a_percent_a_night_is_flagged():
    rng = np.random.default_rng(2)
    flagged = as_creep = 0
    for _ in range(20):
        changes = detect(list(_noisy(rng) * (1 + 0.005 * np.arange(NIGHTS))))
        flagged += bool(changes)
        as_creep += any(c.kind == "creep" for c in changes)
    assert flagged == 20
    assert as_creep >= 12, as_creep  # measured 78/100 named creep, the rest as rising steps
    v = 100 * (1 + 0.005 * np.arange(NIGHTS))
    (c,) = detect(list(v))
    assert c.kind == "creep" and c.ratio == pytest.approx(1 + 0.005 * (NIGHTS - 1), rel=1e-6)


def test_noise_alone_flags_at_most_5_percent_of_histories():
    rng = np.random.default_rng(3)
    flagged = sum(bool(detect(list(_noisy(rng)))) for _ in range(100))
    assert flagged <= 5, flagged


# -- the database ---------------------------------------------------------------------------------
def _results(root, night: int, value: float, mcore: str, *, case="ckpt-memory/mcore/small/tp1-pp1-cp1-dp4[ckpt_format=dp_reshardable]",
             commit="abc1234"):
    day = date(2026, 10, 1) + timedelta(days=night)
    path = root / f"night-{night:02d}" / "ckpt-memory-mcore-small" / "results.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({
        "suite": "ckpt-memory", "model": "small", "world_size": 4, "engine": "mcore", "backend": "gloo",
        "platform": "cpu-gloo", "date": f"{day.isoformat()}T02:00:00+00:00", "judged": True, "verdict": "pass",
        "versions": {"torch": "2.13.0", "megatron-core": mcore, "harness": "0.1.0", "harness_commit": commit},
        "engine_dist": {"name": "megatron-core", "version": mcore}, "label": None,
        "cases": [{"id": case, "outcome": "pass", "metrics": {"save_peak_mib": [value, value / 2]},
                   "samples": {"rank0.save_heap_peak_mib": value}}],
        "checks": [{"check": "ckpt-memory.baseline", "case_id": case, "passed": True, "value": value}],
    }))
    return path


@pytest.fixture
def history(tmp_path):
    """30 nights of ckpt-memory results; megatron-core 0.16.0 -> 0.16.1 at night 20 adds 8% to the peak."""
    rng = np.random.default_rng(0)
    values = _noisy(rng)
    values[20:] *= 1.08
    root = tmp_path / "nightly"
    for night, v in enumerate(values):
        _results(root, night, float(v), "0.16.1" if night >= 20 else "0.16.0")
    return root


def test_ingest_twice_adds_nothing(history, tmp_path):
    con = store.open_db(tmp_path / "h.sqlite")
    assert store.ingest(con, history) == (30, 0)
    first = store.counts(con)
    assert store.ingest(con, history) == (0, 30)
    assert store.counts(con) == first == {"runs": 30, "figures": 30 * 4, "outcomes": 30}
    assert set(store.metrics(con)) == {"rank0.save_heap_peak_mib", "save_peak_mib.rank0", "save_peak_mib.rank1",
                                       "check:ckpt-memory.baseline"}


def test_a_truncated_database_is_refused_and_left_untouched(history, tmp_path, capsys):
    db = tmp_path / "h.sqlite"
    con = store.open_db(db)
    store.ingest(con, history)
    con.close()
    db.write_bytes(db.read_bytes()[:1000])  # truncated mid-page
    before = db.read_bytes()
    code = cli.main(["history", "ingest", str(history), "--db", str(db)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "is corrupt" in err[0] and "left as it is" in err[0], err
    assert db.read_bytes() == before
    db.write_bytes(b"not a database at all")
    assert cli.main(["history", "show", "--metric", "x", "--db", str(db)]) == 2
    assert "is not an SQLite database" in capsys.readouterr().err
    assert db.read_bytes() == b"not a database at all"


def test_another_schema_version_is_refused(tmp_path):
    db = tmp_path / "h.sqlite"
    store.open_db(db).close()
    with sqlite3.connect(db) as con:
        con.execute("UPDATE meta SET value='2' WHERE key='schema_version'")
    with pytest.raises(BadInput, match="schema version 2, this harness reads version 1: upgrade the harness"):
        store.open_db(db)


def test_show_names_the_night_the_versions_and_the_bisect_command(history, tmp_path, capsys):
    db = tmp_path / "h.sqlite"
    assert cli.main(["history", "ingest", str(history), "--db", str(db)]) == 0
    capsys.readouterr()
    plots = tmp_path / "plots"
    assert cli.main(["history", "show", "--metric", "rank0.save_heap_peak_mib", "--db", str(db),
                     "--plots", str(plots)]) == 0
    out = capsys.readouterr().out
    assert "change at 2026-10-21" in out, out
    assert "last night before 2026-10-20, first after 2026-10-21; changed: megatron-core 0.16.0 -> 0.16.1" in out
    assert ("harness bisect --package megatron-core 0.16.0..0.16.1 --suite ckpt-memory --model small --world-size 4 "
            "--layout tp1-pp1-cp1-dp4 --ckpt-format dp_reshardable --engine mcore --metric rank0.save_heap_peak_mib "
            "--max ") in out
    pngs = list(plots.glob("*.png"))
    assert len(pngs) == 1 and pngs[0].stat().st_size > 1000
    assert cli.main(["history", "show", "--metric", "rank0.save_heap_peak_mib", "--db", str(db),
                     "--since", "2026-10-25", "--plots", str(plots)]) == 0
    assert "change at" not in capsys.readouterr().out  # 6 nights, all after the change


def test_show_of_an_unknown_metric_lists_the_known_ones(history, tmp_path, capsys):
    db = tmp_path / "h.sqlite"
    cli.main(["history", "ingest", str(history), "--db", str(db)])
    assert cli.main(["history", "show", "--metric", "step_time", "--db", str(db)]) == 2
    err = capsys.readouterr().err
    assert "no figures of metric 'step_time'" in err and "rank0.save_heap_peak_mib" in err


# -- failing cases in the report's plots ----------------------------------------------------------
def test_failed_cases_are_marked_in_the_checkpoint_and_collective_plots(tmp_path, monkeypatch):
    from harness.report import plots
    from harness.report.runs import RunFile

    peak = {"heap_peak": 2 * 2**20, "children_heap_peak": 0, "device_allocated_peak": 0, "device_reserved_peak": 0,
            "rss_before": 0, "timeline": [(0.0, 0), (0.1, 2**20)]}
    cases = [{"id": f"ckpt-memory/mcore/small/{lay}", "layout": lay, "outcome": outcome, "options": {},
              "data": {"save": {"0": peak, "1": peak}, "collective_bytes": {"0": {"dp all_reduce": 2**20}}}}
             for lay, outcome in (("tp1-pp1-cp1-dp4", "pass"), ("tp2-pp1-cp1-dp2", "regression"))]
    run = RunFile(tmp_path / "results.json", {"suite": "ckpt-memory", "engine": "mcore", "model": "small",
                                              "world_size": 4, "cases": cases, "checks": []})
    marked = []
    real = plots.mark_failed
    monkeypatch.setattr(plots, "mark_failed", lambda ax, cs, failed: (marked.append(set(failed)), real(ax, cs, failed)))
    assert plots.ckpt_peaks(run, tmp_path / "peaks.png").exists()
    assert plots.collective_bytes(run, tmp_path / "bytes.png").exists()
    assert plots.ckpt_timelines(run, tmp_path / "timelines.png").exists()  # titles of failed cases in red
    assert marked == [{"ckpt-memory/mcore/small/tp2-pp1-cp1-dp2"}] * 2


def test_show_refuses_an_unwritable_plots_directory(history, tmp_path, capsys):
    db = tmp_path / "h.sqlite"
    cli.main(["history", "ingest", str(history), "--db", str(db)])
    capsys.readouterr()
    assert cli.main(["history", "show", "--metric", "rank0.save_heap_peak_mib", "--db", str(db),
                     "--plots", "/proc/forbidden"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--plots /proc/forbidden: cannot write there" in err[0], err


# -- the printed bisect command reproduces the case --------------------------------------------------------

def _planned_ids(command: str) -> set[str]:
    """The case ids `harness bisect` would plan from a printed command (parsed by the harness's own parser)."""
    import shlex

    from harness.selection import CaseSelection
    from harness.driver import plan

    args = cli.build_parser().parse_args(shlex.split(command)[1:])
    sel = CaseSelection.from_args(args)
    cases = plan(sel.suite, sel.model, sel.world_size, sel.layout_ids, engine=sel.engine, backend="gloo",
                 options=sel.options, suite_params=sel.suite_params).cases
    return {c.id for c in cases}


@pytest.mark.parametrize("suite,layout,pick", [
    ("ckpt-memory", "tp1-pp1-cp1-dp4", "ckpt_format=fully_reshardable"),
    ("step-perf", "tp1-pp1-cp1-dp4", "use_distributed_optimizer=True,bucket_size"),
])
def test_the_printed_bisect_command_selects_the_same_case(suite, layout, pick):
    from harness.driver import plan
    from harness.history.changes import Change
    from harness.history.show import bisect_commands

    cases = plan(suite, "small", 4, [layout], backend="gloo").cases
    case_id = next(c.id for c in cases if pick in c.id and "ckpt_role" not in c.id and "fully_parallel" not in c.id
                   and "async" not in c.id)
    (command,) = bisect_commands(case_id, "rank0.flops", 4, Change("step", 10, 100.0, 110.0),
                                 {"megatron-core": ("0.16.0", "0.16.1")})
    assert _planned_ids(command) == {case_id}, command  # that case alone: no other case's figure decides


def test_a_timed_metric_is_bisected_with_a_relative_effect_and_every_changed_package_gets_one():
    from harness.history.changes import Change
    from harness.history.show import bisect_commands

    commands = bisect_commands("step-perf/mcore/small/tp1-pp1-cp1-dp4[steps=20]", "step_time_ms", 4,
                               Change("step", 10, 500.0, 600.0),
                               {"transformers": ("4.1", "4.2"), "megatron-core": ("0.16.0", "0.16.1"),
                                "harness_commit": ("abc", "def")})
    assert len(commands) == 2
    assert commands[0].startswith("harness bisect --package megatron-core 0.16.0..0.16.1 ")  # the engine's first
    assert commands[1].startswith("harness bisect --package transformers 4.1..4.2 ")
    assert all(c.endswith("--metric step_time_ms --max baseline+10%") for c in commands), commands


def test_runs_of_another_label_are_another_series(tmp_path, capsys):
    """Nights of a second configuration (label 'bf16', 30% lower) must not read as a change of the first."""
    root = tmp_path / "nightly"
    for night in range(20):
        path = _results(root, night, 100.0 + 0.01 * night, "0.16.0")
        if night % 2:
            data = json.loads(path.read_text())
            data["label"], data["cases"][0]["samples"]["rank0.save_heap_peak_mib"] = "bf16", 70.0 + 0.01 * night
            path.write_text(json.dumps(data))
    db = tmp_path / "h.sqlite"
    assert cli.main(["history", "ingest", str(root), "--db", str(db)]) == 0
    capsys.readouterr()
    assert cli.main(["history", "show", "--metric", "rank0.save_heap_peak_mib", "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert "change at" not in out and "creep" not in out, out
    rows = [line for line in out.splitlines() if line.startswith("cpu-gloo")]
    assert len(rows) == 2 and rows[0].split()[1] == "-" and rows[1].split()[1] == "bf16", out
