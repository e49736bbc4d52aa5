"""`harness history site`: the history database as a static site - an index of the nights, each linking its night's
page (rendered again from its results files where they are still on disk), and per metric the trend of every case
with its change points, creep and stack changes marked. Links are relative: the site moves with its files."""

from __future__ import annotations

import hashlib
import json
import os
import re
import sqlite3
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from harness.errors import BadInput
from harness.files import atomic_write
from harness.history import nights
from harness.history.changes import MIN_SIZE, Change, detect
from harness.history.show import describe, trend_figure
from harness.history.store import metrics, series
from harness.outcomes import NOT_PASSING, OUTCOMES
from harness.report import charts as charting
from harness.report.page import environment, inline_svg, write_page
from harness.report.plots import save_figure
from harness.report.runs import RunFile, read_run
from harness.stack import key as stack_key


@dataclass
class NightRow:
    date: str
    runs: int
    outcomes: dict[str, int]
    not_passing: int
    stack: str
    stack_changed: bool
    page: str | None  # relative link, None where its results are no longer on disk
    missing: int = 0  # results files no longer on disk


@dataclass
class Trend:
    platform: str
    label: str
    case_id: str
    nights: int
    first: str
    last: str
    latest: float
    changes: list[str]
    new: bool  # a change found with the latest night that was not found without it
    chart: str = ""  # gzipped, base64 SVG; "" for a series without a change
    notes: list[str] = field(default_factory=list)


@dataclass
class MetricPage:
    metric: str
    slug: str
    trends: list[Trend]

    @property
    def changed(self) -> list[Trend]:
        return [t for t in self.trends if t.changes]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", text)


def nights_of(con: sqlite3.Connection) -> dict[str, list[tuple[int, str, str, str]]]:
    """night (YYYY-MM-DD) -> its runs (id, results path, versions JSON, the results file's digest), oldest first."""
    out: dict[str, list[tuple[int, str, str, str]]] = {}
    for rid, date, path, versions, digest in con.execute(
            "SELECT id, date, path, versions, digest FROM runs ORDER BY date, id"):
        out.setdefault(date[:10], []).append((rid, path, versions, digest))
    return out


def _new(values: list[float], changes: list[Change]) -> bool:
    """Whether the latest night brought a change the history without it did not show (a step needs MIN_SIZE nights
    on each side, so a step is new on the night its third night after it arrives). A change the shorter history
    already showed in the same direction is not new where PELT moved it: a step by up to MIN_SIZE nights, or a
    step read as creep (or back) over the same nights."""
    before = detect(values[:-1])

    def seen(c: Change) -> bool:
        return any((b.ratio > 1) == (c.ratio > 1) and (
            c.kind != "step" or b.kind != "step" or abs(b.index - c.index) <= MIN_SIZE) for b in before)

    return any(not seen(c) for c in changes)


def metric_page(con: sqlite3.Connection, metric: str, charts_dir: Path) -> MetricPage:
    world = dict(con.execute("SELECT id, world_size FROM runs"))
    trends = []
    for (platform, label, case_id), points in sorted(series(con, metric).items()):
        values = [p.value for p in points]
        changes = detect(values)
        t = Trend(platform, label or "-", case_id, len(points), points[0].date[:10], points[-1].date[:10],
                  points[-1].value, ["; ".join(f"{c.kind} {(c.ratio - 1) * 100:+.1f}%" + (
                      f" at {points[c.index].date[:10]}" if c.kind == "step" else "") for c in changes)] if changes
                  else [], new=bool(changes) and _new(values, changes))
        if changes:
            name = _slug(f"{platform}-{stack_key(points[-1].versions)}-{label}-{case_id}-{metric}")
            plt, fig = trend_figure(case_id, metric, points, changes)
            t.chart = inline_svg(save_figure(plt, fig, charts_dir / f"{name}.png", 100).with_suffix(".svg"))
            said = describe(case_id, metric, points, changes, world.get(points[-1].run_id))
            t.notes = [line.strip() for line in said]
        trends.append(t)
    return MetricPage(metric, _slug(metric), trends)


def _readable(path: str, digest: str) -> RunFile | None:
    """The results file the database ingested, if it is still on disk as it was: a nightly that reuses its --out
    writes the next night's file at the same path."""
    file = Path(path)
    try:
        if not file.is_file() or hashlib.sha256(file.read_bytes()).hexdigest() != digest:
            return None
        return read_run(file)
    except (OSError, BadInput):  # unreadable or damaged since it was ingested: the night is listed without it
        return None


def _night_rows(con: sqlite3.Connection, out: Path, rebuild: bool) -> list[NightRow]:
    """Every night, and its page written where it has none, or one of other runs than the database now holds for it
    (another stack's runs ingested later, a night past midnight): the runs a page shows are kept in nights.json."""
    built_path = out / "nights.json"
    try:
        built: dict[str, list[int]] = json.loads(built_path.read_text())
    except (OSError, ValueError):
        built = {}
    rows = []
    previous_stack = None
    for night, runs in nights_of(con).items():
        ids = [r[0] for r in runs]
        outcomes = Counter(o for (o,) in con.execute(
            f"SELECT outcome FROM outcomes WHERE run_id IN ({','.join('?' * len(runs))})", ids))
        stack = " / ".join(sorted({stack_key(json.loads(v)) for _, _, v, _ in runs}))
        page = out / "nights" / f"{night}.html"
        loaded = [r for r in (_readable(p, digest) for _, p, _, digest in runs) if r is not None]
        if loaded and (rebuild or not page.exists() or built.get(night) != ids):
            with tempfile.TemporaryDirectory(prefix="harness-site-") as tmp:
                root = Path(os.path.commonpath([str(r.path.parent) for r in loaded]))
                write_page(loaded, charting.render_all(loaded, Path(tmp)), page, nights.compare(con, loaded), root)
            built[night] = ids
        rows.append(NightRow(night, len(runs), {o: outcomes[o] for o in OUTCOMES if outcomes[o]},
                             sum(outcomes[o] for o in NOT_PASSING), stack,
                             previous_stack is not None and stack != previous_stack,
                             f"nights/{night}.html" if page.exists() else None, len(runs) - len(loaded)))
        previous_stack = stack
    atomic_write(built_path, json.dumps(built, indent=1, sort_keys=True))
    return rows[::-1]


def write_site(con: sqlite3.Connection, out: Path, rebuild: bool = False) -> dict[str, int]:
    """index.html, nights/<night>.html and metrics/<metric>.html under out; what was written, counted."""
    env = environment()
    (out / "nights").mkdir(parents=True, exist_ok=True)
    (out / "metrics").mkdir(parents=True, exist_ok=True)
    night_rows = _night_rows(con, out, rebuild)
    last_night = night_rows[0].date if night_rows else ""
    pages = []
    with tempfile.TemporaryDirectory(prefix="harness-site-") as tmp:
        for metric in metrics(con):
            page = metric_page(con, metric, Path(tmp))
            atomic_write(out / "metrics" / f"{page.slug}.html",
                         env.get_template("metric.html").render(page=page, last_night=last_night))
            pages.append(page)
    new = [(p, t) for p in pages for t in p.trends if t.new]
    atomic_write(out / "index.html", env.get_template("site.html").render(
        nights=night_rows, metrics=pages, new=new, last_night=last_night))
    return {"nights": len(night_rows), "night pages": sum(bool(r.page) for r in night_rows),
            "metrics": len(pages), "trends": sum(len(p.trends) for p in pages),
            "changed": sum(len(p.changed) for p in pages)}
