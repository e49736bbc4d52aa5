"""What `harness report` draws says what it shows: no two series of one plot share a colour (an MoE run's
collectives have more (group role, kind) series than tab20 has colours), and a run none of the plots draws from
gets a line saying so, not an empty plots/ folder."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("matplotlib")

ROLES = ("dp-cp", "edp", "ep", "etp-ep", "tp", "cp", "pp", "tp-ep", "etp", "mp", "emb")
KINDS = ("all_reduce", "all_gather")


def _run_file(path, suite: str, cases: list[dict]):
    from harness.report.runs import load_runs

    path.mkdir(parents=True, exist_ok=True)
    (path / "results.json").write_text(json.dumps({
        "suite": suite, "model": "tiny-moe", "world_size": 2, "engine": "mcore", "backend": "gloo",
        "platform": "cpu-gloo", "versions": {}, "date": "2026-11-28", "wall_s": 1.0, "passed": True,
        "verdict": "pass", "exit_code": 0, "cases": cases, "checks": []}))
    return load_runs(path)


def _case(i: int, data: dict) -> dict:
    return {"id": f"s/mcore/tiny-moe/tp1-pp1-cp1-dp2[seed={i}]", "layout": "tp1-pp1-cp1-dp2", "options": {},
            "status": "ok", "outcome": "pass", "data": data}


def test_no_two_series_of_the_collective_bytes_plot_share_a_colour(tmp_path, monkeypatch):
    from harness.report import plots

    per_rank = {f"{role}/{kind}": 1024 * (k + 1) for k, (role, kind) in
                enumerate((r, k) for r in ROLES for k in KINDS)}  # 22 series
    [run] = _run_file(tmp_path / "run", "grad-sync", [_case(i, {"collective_bytes": {"0": per_rank}})
                                                      for i in range(3)])
    drawn = {}
    finish = plots.finish_per_case

    def keep_axes(plt, fig, ax, *args, **kwargs):
        handles, labels = ax.get_legend_handles_labels()
        drawn.update({label: tuple(h.patches[0].get_facecolor()) for h, label in zip(handles, labels)})
        return finish(plt, fig, ax, *args, **kwargs)

    monkeypatch.setattr(plots, "finish_per_case", keep_axes)
    assert plots.collective_bytes(run, tmp_path / "bytes.png")
    assert len(drawn) == 22
    assert len(set(drawn.values())) == 22, "series in the same colour: " + ", ".join(
        sorted(label for label, c in drawn.items() if list(drawn.values()).count(c) > 1))


def test_a_run_without_plots_says_why_and_leaves_no_empty_folder(tmp_path):
    from harness.report.directory import write_report

    _run_file(tmp_path, "equivalence", [_case(0, {})])
    write_report(tmp_path)
    assert not (tmp_path / "plots").exists()
    assert "No plot: none of the report's plots draws from this run's results" in (tmp_path / "report.md").read_text()
