"""`harness history site`: 30 synthetic nights with one step (megatron-core 0.16.0 -> 0.16.1 at night 20 adds 8% to
a checkpoint peak) and a second case 20% up on its last two nights - the index lists every night and links its page, the
step is marked on its metric's trend beside the stack's change, the late step is named new with the latest night;
in headless Chromium, nothing is requested beyond the site's own files and every link resolves."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest

from harness import cli
from tests.support import browser
from tests.test_history import _noisy, _results

pytest.importorskip("matplotlib")
pytest.importorskip("jinja2")
LATE = "ckpt-memory/mcore/small/tp2-pp1-cp1-dp2[ckpt_format=dp_reshardable]"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site, written once for the module's tests (one of which writes it again, the same)."""
    tmp_path = tmp_path_factory.mktemp("history")
    rng = np.random.default_rng(0)
    values, late = _noisy(rng), _noisy(rng)
    values[20:] *= 1.08
    late[28:] *= 1.2  # its last two nights: no step the night before, one tonight (placed at night 27)
    root = tmp_path / "nightly"
    for night, (v, w) in enumerate(zip(values, late)):
        _results(root / "a", night, float(v), "0.16.1" if night >= 20 else "0.16.0")
        _results(root / "b", night, float(w), "0.16.1" if night >= 20 else "0.16.0", case=LATE)
    db = tmp_path / "h.sqlite"
    assert cli.main(["history", "ingest", str(root), "--db", str(db)]) == 0
    assert cli.main(["history", "site", "--db", str(db), "--out", str(tmp_path / "site")]) == 0
    return tmp_path / "site"


def test_the_index_lists_every_night_with_its_page_and_names_the_change_new_with_the_latest_night(site):
    index = (site / "index.html").read_text()
    links = re.findall(r'<a href="(nights/[^"]+)">', index)
    assert len(links) == 30 and all((site / link).is_file() for link in links)
    assert links[0] == "nights/2026-10-30.html"  # newest first
    assert index.count("(stack changed)") == 1 and re.search(r"2026-10-21</a>.*?\(stack changed\)", index, re.S)
    new = re.search(r'<table id="new-table">(.*?)</table>', index, re.S).group(1)
    assert LATE in new and "tp1-pp1-cp1-dp4" not in new  # the step at night 20 is old news
    page = (site / "metrics" / "rank0.save_heap_peak_mib.html").read_text()
    assert "step +" in page and "at 2026-10-21" in page
    assert "harness bisect --package megatron-core 0.16.0..0.16.1" in page


def test_a_second_site_renders_only_the_nights_without_a_page(site, capsys):
    night = site / "nights" / "2026-10-05.html"
    night.unlink()
    before = (site / "nights" / "2026-10-06.html").stat().st_mtime_ns
    assert cli.main(["history", "site", "--db", str(site.parent / "h.sqlite"), "--out", str(site)]) == 0
    assert night.is_file() and (site / "nights" / "2026-10-06.html").stat().st_mtime_ns == before
    assert "30 nights, 30 night pages" in capsys.readouterr().out


def test_in_a_browser_the_site_links_its_nights_and_draws_the_step_beside_the_stack_change(site, tmp_path):
    from tests.test_report_page import _need_browser

    _need_browser()
    shots = Path(os.environ.get("HARNESS_SCREENSHOTS") or tmp_path)
    with browser.Browser() as b:
        index = b.open((site / "index.html").as_uri())
        hrefs = index.evaluate("Array.from(document.querySelectorAll('a')).map(a => a.href)")
        assert all(h.startswith(site.as_uri() + "/") for h in hrefs), "a link leaves the site"
        missing = [h for h in hrefs if not Path(h.removeprefix("file://")).is_file()]
        assert not missing, f"links to nothing: {missing}"
        index_seen = index.seen
        trend = b.open((site / "metrics" / "rank0.save_heap_peak_mib.html").as_uri())
        trend.wait_for("document.body.getAttribute('data-charts') === 'drawn'")
        names = trend.evaluate("JSON.parse(document.querySelector('figure.chart svg').getAttribute('data-series'))")
        assert names == ["rank0.save_heap_peak_mib", "stack changed", "change point"]
        drawn = trend.evaluate("[0, 1, 2].map(k => document.querySelectorAll("
                               "'figure.chart svg [id*=\"-s' + k + '-\"]').length)")
        assert all(drawn), f"series without an element: {drawn}"
        trend.screenshot(shots / "history-trend.png", height=620)
        trend_seen = trend.seen
    for seen in (index_seen, trend_seen):
        assert seen.errors == []
        assert all(u.startswith(site.as_uri()) for u in seen.requests), seen.requests


def test_a_night_whose_results_file_was_replaced_is_not_rendered_from_another_nights(tmp_path, capsys):
    """As `harness nightly --out nightly-out` every night leaves it: one path, each night's file in turn. The site
    renders a night's page only from the file the database ingested (its digest), and again when the database
    holds other runs for the night than its page shows."""
    import json

    root, db, out = tmp_path / "nightly", tmp_path / "h.sqlite", tmp_path / "site"
    for night in range(6):
        _results(root, night, 100.0 + night, "0.16.0")
    assert cli.main(["history", "ingest", str(root), "--db", str(db)]) == 0
    replaced = root / "night-02" / "ckpt-memory-mcore-small" / "results.json"
    replaced.write_text(replaced.read_text().replace('"2026-10-03T', '"2026-10-09T'))  # a later night's file there
    assert cli.main(["history", "site", "--db", str(db), "--out", str(out)]) == 0
    index = (out / "index.html").read_text()
    assert "2026-10-03 <span class=\"muted\">(results no longer on disk)</span>" in index
    assert not (out / "nights" / "2026-10-03.html").exists()
    assert json.loads((out / "nights.json").read_text())["2026-10-04"] == [4]
    # another run of an existing night ingested later (another stack's): that night's page is written again
    page = out / "nights" / "2026-10-04.html"
    before = page.stat().st_mtime_ns
    _results(tmp_path / "other", 3, 111.0, "0.16.0", case="ckpt-memory/mcore/small/tp2-pp1-cp1-dp2[ckpt_format=x]")
    assert cli.main(["history", "ingest", str(tmp_path / "other"), "--db", str(db)]) == 0
    capsys.readouterr()
    assert cli.main(["history", "site", "--db", str(db), "--out", str(out)]) == 0
    assert page.stat().st_mtime_ns != before and "tp2-pp1-cp1-dp2" in page.read_text()
    assert json.loads((out / "nights.json").read_text())["2026-10-04"] == [4, 7]
