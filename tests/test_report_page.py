"""The night's page (report.html): what did not pass, since which night and on which stack, the commands that
follow a failure up, the charts - read from the page as written and, in a real headless Chromium, as a browser
shows it: no console error, no request beyond the page's own file, the regression rows and their links, a filter
that narrows the table, every chart's series."""

from __future__ import annotations

import os
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from tests.support import browser
from tests.fakes.night_pages import RECORD, history, night

pytest.importorskip("matplotlib")
pytest.importorskip("jinja2")


@pytest.fixture(scope="module")
def page_dir(tmp_path_factory):
    """Tonight's page, rendered once for the module's tests (which only read it)."""
    from harness.report.directory import write_report

    tmp_path = tmp_path_factory.mktemp("page")
    out = night(tmp_path / "night", rl=True)
    db = history(tmp_path / "history.sqlite", tmp_path / "earlier")
    from harness.history import nights, store

    con = store.open_db(db, create=False)
    written = write_report(out, lambda runs: nights.compare(con, runs))
    con.close()
    assert written["html"] == out / "report.html"
    return out


def _text(html: str) -> str:
    """The page's visible text, whitespace squeezed."""
    class Text(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.parts: list[str] = []
            self.skip = 0

        def handle_starttag(self, tag, attrs):
            self.skip += tag in ("script", "style")

        def handle_endtag(self, tag):
            self.skip -= tag in ("script", "style")

        def handle_data(self, data):
            if not self.skip:
                self.parts.append(data)

    p = Text()
    p.feed(html)
    return re.sub(r"\s+", " ", " ".join(p.parts))


def test_the_page_says_what_did_not_pass_since_when_on_which_stack_and_what_to_run(page_dir):
    html = (page_dir / "report.html").read_text()
    text = _text(html)
    assert "Did not pass tonight (4)" in text and "1 new tonight, 0 passing again" in text
    # the TP 2 case passed the night before: new; the untied one has failed for three nights
    assert re.search(r"tp2-pp1-cp1-dp2 regression refit.baseline new tonight \(it was pass on 2026-12-05\)", text)
    assert re.search(r"tp1-pp2-cp1-dp2 \[variant=untied\] regression refit.baseline since 2026-12-04 \(3 nights\)",
                     text)
    assert "Stack changed: refit / mcore / tiny / world size 4: megatron-core 0.19.1 -> 0.19.2 since 2026-12-05" in text
    assert "megatron-core 0.19.2" in text and "Python 3.12.1" in text
    # the command the check printed, and the one that reruns the case, each ready to copy
    commands = re.findall(r'<pre class="command">([^<]*)</pre>', html)
    assert RECORD in commands
    assert ("harness run --suite refit --model tiny --world-size 4 --layout tp2-pp1-cp1-dp2 --engine mcore"
            in commands)
    # new tonight on another megatron-core: the bisect over the releases between the two nights, ready to copy
    assert ("harness bisect --package megatron-core 0.19.1..0.19.2 --suite refit --model tiny --world-size 4 --layout "
            "tp2-pp1-cp1-dp2 --engine mcore --metric fail") in commands
    assert not any("bisect" in c and "untied" in c for c in commands)  # it failed before the stack changed
    assert "CANNOT TELL ckpt-memory.async" in text
    # batch-split has no earlier night in the history: said so, not counted as new
    assert re.search(r"tp2-pp1-cp1-dp2 \[cut=mbs2\] regression batch-split.grad_norm its first night in the history",
                     text)
    # the interrupted run says so at the top
    assert "partial: interrupted (SIGINT) after 1 of 4 cases" in text.split("Did not pass tonight")[0]


def test_the_page_is_one_file_that_asks_nothing_of_any_other_host(page_dir):
    html = (page_dir / "report.html").read_text()
    assert not re.findall(r'(?:src|href)="(?!#)[^"]*"', html), "the page links or loads another file"
    assert "http://" not in _text(html) and "https://" not in html
    assert "Content-Security-Policy" in html and "default-src 'none'" in html


def test_the_rl_suites_plots_draw_the_planted_faults_apart(page_dir):
    """batch-split's drifting cut is named failed in its chart; refit's regression is drawn against its baseline;
    rl-cycle's growing residue crosses its bound."""
    import json
    from html import unescape

    def series(name: str) -> list[str]:
        svg = next((page_dir / "plots").glob(f"*-{name}.svg")).read_text()
        return json.loads(unescape(re.search(r'data-series="([^"]*)"', svg).group(1)))

    steps = series("steps-vs-reference")
    assert "tp2-pp1-cp1-dp2 cut=mbs2 (failed)" in steps and "tp1-pp1-cp2-dp2 cut=tokens96" in steps
    assert "tolerance 1e-05" in steps
    assert sorted(series("export-peaks")) == ["bound", "rank 0", "rank 1", "rank 2", "rank 3"]
    assert sorted(series("residue")) == ["rank 0", "rank 1", "rank 2", "rank 3", "residue bound"]
    assert sorted(series("logprob-agreement")) == ["tolerance 1e-05", "worst rel. difference of a held-out token"]


def test_harness_report_compares_with_the_history_beside_the_results_and_junit_names_the_page(tmp_path, capsys):
    """As `harness nightly` leaves them: DIR/history.sqlite is the default history of `harness report DIR`."""
    import xml.etree.ElementTree as ET

    from harness import cli
    from tests.fakes.night_pages import refit_run

    refit_run(tmp_path / "night" / "refit")
    history(tmp_path / "night" / "history.sqlite", tmp_path / "earlier")
    assert cli.main(["report", str(tmp_path / "night")]) == 0
    assert "html: " in capsys.readouterr().out
    assert "new tonight (it was pass on 2026-12-05)" in _text((tmp_path / "night" / "report.html").read_text())
    suite = ET.parse(tmp_path / "night" / "junit.xml").getroot().find("testsuite")
    assert {p.get("name"): p.get("value") for p in suite.iter("property")}["report"] == "report.html"


def _drawn(monkeypatch, module: str, plot, run_path):
    """The figure a plot function drew (its save replaced by keeping the figure)."""
    from harness.report import check_plots, rl_plots
    from harness.report.runs import read_run

    kept = []
    target = {"rl_plots": rl_plots, "check_plots": check_plots}[module]
    monkeypatch.setattr(target, "save_figure", lambda plt, fig, path, dpi: kept.append(fig) or path)
    assert plot(read_run(run_path), run_path.parent / "x.png")
    return kept[0]


def test_the_rl_plots_draw_the_planted_figures_where_they_are(tmp_path, monkeypatch):
    """The growing residue crosses its bound in its own panel; the drifting cut's gradient norm is above the
    tolerance where the other's is below; a NaN is drawn at the top and marked."""
    import json

    from harness.report import check_plots, rl_plots
    from tests.fakes.night_pages import batch_split_run, rl_cycle_run

    fig = _drawn(monkeypatch, "rl_plots", rl_plots.rl_cycle_residue, rl_cycle_run(tmp_path / "rl"))
    flat, grows = fig.axes[0], fig.axes[1]
    bound = 192.0
    assert max(max(line.get_ydata()) for line in flat.lines if line.get_label() != "residue bound") < bound
    assert [list(line.get_ydata()) for line in grows.lines][0] == [70.0, 140.0, 210.0, 280.0]
    assert grows.get_title().endswith("(regression)")

    path = batch_split_run(tmp_path / "bs")
    fig = _drawn(monkeypatch, "check_plots", check_plots.steps_against_reference, path)
    names = [line.get_label() for line in fig.axes[0].lines[:2]]  # the legend names the cases once, on the left
    assert names == ["tp1-pp1-cp2-dp2 cut=tokens96", "tp2-pp1-cp1-dp2 cut=mbs2 (failed)"]
    good, bad = (list(line.get_ydata()) for line in fig.axes[1].lines[:2])  # the gradient norms, in that order
    assert max(bad) > 1e-5 > max(good)
    data = json.loads(path.read_text())
    data["checks"][1]["data"]["got"][2] = float("nan")
    path.write_text(json.dumps(data))
    fig = _drawn(monkeypatch, "check_plots", check_plots.steps_against_reference, path)
    marks = [line for line in fig.axes[1].lines if line.get_label() == "not finite"]
    assert marks and list(marks[0].get_ydata()) == [check_plots.CEILING]


def test_a_night_without_history_names_no_since_and_a_page_of_passing_runs_says_nothing_regressed(tmp_path):
    from harness.report.directory import write_report
    from tests.fakes.night_pages import ckpt_run, refit_run

    ckpt_run(tmp_path / "n")
    write_report(tmp_path / "n")
    text = _text((tmp_path / "n" / "report.html").read_text())
    assert "Nothing regressed tonight" in text and "regression-table" not in text
    refit_run(tmp_path / "r")  # two regressions, no history: since "-", no count of what is new
    write_report(tmp_path / "r")
    html = (tmp_path / "r" / "report.html").read_text()
    cells = re.findall(r'<tr class="regression-row">.*?<td[^>]*>([^<]*)\s*</td></tr>', html, re.S)
    assert [c.strip() for c in cells] == ["-", "-"] and 'id="news"' not in html


# -- in the browser -------------------------------------------------------------------------------------------
def _need_browser() -> None:
    if browser.available():
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"no browser at {browser.BROWSER} under CI=true: .ci/run installs Debian's chromium package")
    pytest.skip(f"no browser at {browser.BROWSER}: apt-get install chromium (the page's browser tests need it)")


def test_the_browser_tests_catch_a_console_error_and_a_request_to_another_host(tmp_path):
    """The assertions below can fail: a page that logs an error and loads an image from elsewhere shows both."""
    _need_browser()
    bad = tmp_path / "bad.html"
    bad.write_text('<!doctype html><html><body><img src="http://203.0.113.9/x.png">'
                   '<script>console.error("planted"); undefined_function();</script></body></html>')
    with browser.Browser() as b:
        page = b.open(bad.as_uri())
        b.pump(0.5)
        seen = page.seen
    assert any("planted" in e for e in seen.errors) and any("undefined_function" in e for e in seen.errors)
    assert "http://203.0.113.9/x.png" in seen.requests


def test_in_a_browser_the_page_shows_its_regressions_filters_its_cases_and_draws_every_series(page_dir, tmp_path):
    _need_browser()
    url = (page_dir / "report.html").as_uri()
    shots = Path(os.environ.get("HARNESS_SCREENSHOTS") or tmp_path)
    with browser.Browser() as b:
        page = b.open(url)
        page.wait_for("document.body.getAttribute('data-charts') === 'drawn'")
        rows = page.evaluate("Array.from(document.querySelectorAll('#regression-table tr.regression-row'))"
                             ".map(r => [r.cells[3].textContent.trim(), r.querySelector('a').getAttribute('href')])")
        assert [r[0] for r in rows] == ["tp2-pp1-cp1-dp2 [cut=mbs2]", "tp2-pp1-cp1-dp2",
                                        "tp1-pp2-cp1-dp2 [variant=untied]", "tp2-pp1-cp1-dp2"]
        for _, href in rows:  # each link leads to its run's section
            assert page.evaluate(f"document.getElementById({href[1:]!r}) !== null")
        total = page.evaluate("document.querySelectorAll('tr.case-row').length")
        assert total == 11 and page.evaluate("document.getElementById('shown').textContent") == "11 of 11 cases shown"
        page.evaluate("(() => { const s = document.querySelector('select[data-filter=outcome]'); s.value = "
                      "'regression'; s.dispatchEvent(new Event('change')); })()")
        visible = page.evaluate("Array.from(document.querySelectorAll('tr.case-row:not(.hidden)'))"
                                ".map(r => r.getAttribute('data-outcome'))")
        assert visible == ["regression"] * 4
        assert page.evaluate("location.hash") == "#outcome=regression"
        assert page.evaluate("document.querySelectorAll('section.run:not(.hidden)').length") == 3
        page.evaluate("(() => { const s = document.querySelector('select[data-filter=suite]'); s.value = 'refit'; "
                      "s.dispatchEvent(new Event('change')); })()")
        assert page.evaluate("document.getElementById('shown').textContent") == "2 of 11 cases shown"
        # every chart's series: each legend entry named in its SVG and drawn under its id
        charts = page.evaluate("""Array.from(document.querySelectorAll('figure.chart')).map(f => {
            const svg = f.querySelector('svg');
            const names = JSON.parse(svg.getAttribute('data-series'));
            const texts = Array.from(svg.querySelectorAll('text')).map(t => t.textContent);
            return [f.getAttribute('data-chart'), names, names.map((n, k) =>
                svg.querySelectorAll('[id*="-s' + k + '-"]').length > 0 && texts.includes(n))];
        })""")
        assert sorted(c[0] for c in charts) == ["export-peaks", "logprob-agreement", "peaks", "residue",
                                                "save-timeline", "steps-vs-reference"]
        for name, names, drawn in charts:
            assert names and all(drawn), f"{name}: series not drawn or not in the legend: {names} {drawn}"
        for name in ("outcome", "suite"):
            page.evaluate(f"(() => {{ const s = document.querySelector('select[data-filter={name}]'); s.value = ''; "
                          "s.dispatchEvent(new Event('change')); })()")
        page.screenshot(shots / "night-page.png", height=900)
        seen = page.seen
    assert seen.errors == []
    assert set(seen.requests) == {url}, f"requests beyond the page: {sorted(set(seen.requests) - {url})}"
