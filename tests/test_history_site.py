"""`harness history site`: 30 synthetic nights with one step (megatron-core 0.16.0 -> 0.16.1 at night 20 adds 8% to
a checkpoint peak) and a second case that steps at night 27 - the index lists every night and links its page, the
step is marked on its metric's trend beside the stack's change, the late step is named new with the latest night;
in headless Chromium, nothing is requested beyond the site's own files and every link resolves."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest

from harness import cli
from tests import browser
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
    late[27:] *= 1.15
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
