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


def test_golden_steps_are_drawn_in_each_steps_own_tolerance_and_the_step_that_left_it_above_it(tmp_path, monkeypatch):
    """The trajectory golden judged, as its check records it: the case whose step 2 left the tolerance is drawn
    above 1 there and named failed; a step held exactly (the learning rate) at the floor; a NaN at the ceiling."""
    import dataclasses

    from harness.report import check_plots
    from harness.report.plots import FLOOR
    from harness.suite_defs.golden.judge import judge
    from tests.test_golden import GOLDEN, _entry

    def recorded(cid: str, measured: dict) -> dict:
        (trajectory,) = [c for c in judge(cid, "tiny/fp32/steps=3", "fp32", measured, _entry(GOLDEN))
                         if c.check == "golden.trajectory"]
        return {"check": trajectory.check, "case_id": cid, "status": "pass" if trajectory.passed else "fail",
                "message": trajectory.message, "data": dataclasses.asdict(trajectory.data)}

    cases = [_case(0, {}), {**_case(1, {}), "outcome": "regression"}]
    [run] = _run_file(tmp_path / "run", "golden", cases)
    run.data["checks"] = [recorded(cases[0]["id"], dict(GOLDEN)),
                          recorded(cases[1]["id"], dict(GOLDEN, **{"step02.grad_norm": 0.6001,
                                                                   "step03.loss": float("nan")}))]
    kept = []
    monkeypatch.setattr(check_plots, "save_figure", lambda plt, fig, path, dpi: kept.append(fig) or path)
    assert check_plots.steps_against_stored(run, tmp_path / "x.png")
    panels = {ax.get_title().split(" per step")[0]: ax for ax in kept[0].axes}
    assert sorted(panels) == ["grad_norm", "loss", "lr", "num_zeros"]
    good, bad, tolerance = panels["grad_norm"].lines
    assert good.get_label() == "tp1-pp1-cp1-dp2 seed=0" and bad.get_label() == "tp1-pp1-cp1-dp2 seed=1 (failed)"
    assert list(tolerance.get_ydata()) == [1.0, 1.0]
    assert list(bad.get_xdata()) == [1, 2, 3] and bad.get_ydata()[1] > 1.0 > max(good.get_ydata())
    assert list(panels["lr"].lines[0].get_ydata()) == [FLOOR] * 3  # held exactly: drawn at the floor
    assert panels["loss"].lines[1].get_ydata()[2] == check_plots.CEILING  # NaN: at the ceiling


def test_dynamic_cps_gradients_are_drawn_per_tensor_against_no_cp_and_the_planted_one_above_the_tolerance(
        tmp_path, monkeypatch):
    """Each case's gradient errors per tensor as dynamic-cp's check records them: the case whose loss was scaled by
    1/DP (R3) is drawn above the tolerance at every tensor and named failed; the bit-for-bit one at the floor; a NaN
    at the ceiling."""
    import dataclasses

    from harness.checks import ParamErrors
    from harness.report import check_plots
    from harness.report.plots import FLOOR

    cases = [_case(0, {}), {**_case(1, {}), "outcome": "regression"}, _case(2, {})]
    [run] = _run_file(tmp_path / "run", "dynamic-cp", cases)
    names = ["embedding.word_embeddings.weight", "decoder.layers.0.mlp.linear_fc1.weight"]

    def recorded(case: dict, errors: list[float]) -> dict:
        data = ParamErrors(cases[2]["id"], 1e-5, dict(zip(names, errors)))
        return {"check": "dynamic-cp.grads", "case_id": case["id"], "status": "pass", "message": "",
                "data": dataclasses.asdict(data)}

    run.data["checks"] = [recorded(cases[0], [0.0, 3e-8]), recorded(cases[1], [0.5, float("nan")])]
    kept = []
    monkeypatch.setattr(check_plots, "save_figure", lambda plt, fig, path, dpi: kept.append(fig) or path)
    assert check_plots.params_against_reference(run, tmp_path / "x.png")
    (ax,) = kept[0].axes
    good, bad, tolerance = ax.lines
    assert good.get_label() == "tp1-pp1-cp1-dp2 seed=0" and bad.get_label() == "tp1-pp1-cp1-dp2 seed=1 (failed)"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0.mlp.linear_fc1.weight", "embedding.word_embeddings.weight"]
    assert list(good.get_ydata()) == [3e-8, FLOOR]  # in the tensors' order; bit for bit at the floor
    assert list(bad.get_ydata()) == [check_plots.CEILING, 0.5] and tolerance.get_ydata()[0] == 1e-5


def test_peft_ckpts_adapter_is_drawn_and_a_merging_export_stands_above_its_bound(tmp_path, monkeypatch):
    """As peft-ckpt's checks record them: the case whose export merged the base weights into the adapter (tests/
    faulty_peft.py:MergedExport) is drawn above the bound and named failed, its log-probs above the tolerance; the
    passing case's export peaks under the bound, its log-probs under the tolerance, a NaN at the ceiling."""
    import dataclasses

    from harness.checks import Agreement, HostPeaks
    from harness.report import adapter_plots, check_plots

    cases = [_case(0, {}), {**_case(1, {}), "outcome": "regression"}]
    [run] = _run_file(tmp_path / "run", "peft-ckpt", cases)
    mib = 1 << 20

    def recorded(case: dict, check: str, data) -> dict:
        return {"check": check, "case_id": case["id"], "status": "pass", "message": "", "data": dataclasses.asdict(data)}

    run.data["checks"] = [
        recorded(cases[0], "peft-ckpt.logprobs", Agreement(2e-7, 1e-5, 0, 512)),
        recorded(cases[0], "peft-ckpt.roundtrip", Agreement(float("nan"), 1e-5, 512, 512)),
        recorded(cases[0], "peft-ckpt.memory", HostPeaks({0: 2 * mib, 1: mib}, 6 * mib, 23 * mib)),
        recorded(cases[1], "peft-ckpt.logprobs", Agreement(0.3, 1e-5, 511, 512)),
        recorded(cases[1], "peft-ckpt.memory", HostPeaks({0: 19 * mib, 1: 18 * mib}, 6 * mib, 23 * mib))]
    kept = []
    monkeypatch.setattr(check_plots, "save_figure", lambda plt, fig, path, dpi: kept.append(fig) or path)
    assert adapter_plots.adapter_export(run, tmp_path / "x.png")
    logprobs, peaks = kept[0].axes
    bars = {(c.get_label(), round(p.get_x() + p.get_width() / 2)): p.get_height()
            for c in logprobs.containers for p in c.patches}
    assert bars[("HF + PEFT against Megatron", 1)] > 1e-5 > bars[("HF + PEFT against Megatron", 0)]
    assert max(h for (name, _), h in bars.items() if "reloaded into" in name) == check_plots.CEILING
    [tolerance] = [line for line in logprobs.lines if line.get_label() == "tolerance 1e-05"]
    bound, whole = (next(line for line in peaks.lines if line.get_label() == name).get_ydata()[0]
                    for name in ("bound", "the whole model (a merging export)"))
    heights = [(round(p.get_x() + p.get_width() / 2), p.get_height()) for p in peaks.patches]
    assert bound == 6 and whole == 23 and max(h for x, h in heights if x == 0) < bound < min(h for x, h in heights
                                                                                              if x == 1)
    assert [t.get_color() for t in peaks.get_xticklabels()][1] == "red"  # the failed case's label
