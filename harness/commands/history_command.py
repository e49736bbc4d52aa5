"""`harness history ingest|show|site`: every nightly figure in a SQLite database; trends and change points, printed
or as a static site."""

from __future__ import annotations

from pathlib import Path

from harness.errors import BadInput
from harness.history import show as history_show
from harness.history import site as history_site
from harness.history import store
from harness.history.store import DEFAULT_DB
from harness.report.directory import prepare_out_dir


def add_parser(sub) -> None:
    p = sub.add_parser("history", help="every nightly figure in a SQLite database; trends and change points")
    hsub = p.add_subparsers(dest="history_command", required=True)
    ing = hsub.add_parser("ingest", help="every results.json below DIR into the database (twice adds nothing)")
    ing.add_argument("dir")
    ing.add_argument("--db", default=None, help="default nightly-out/history.sqlite")
    ing.set_defaults(func=ingest)
    sh = hsub.add_parser("show", help="a metric per case: table, change points, bisect commands, PNG trends")
    sh.add_argument("--metric", required=True, help="e.g. rank0.save_heap_peak_mib, step_time_ms, check:<name>")
    sh.add_argument("--case", default="*", help="glob over case ids (default: every case)")
    sh.add_argument("--since", default=None, help="first night, YYYY-MM-DD")
    sh.add_argument("--db", default=None, help="default nightly-out/history.sqlite")
    sh.add_argument("--plots", default=None, help="directory for one PNG trend per case (default: next to the db)")
    sh.set_defaults(func=show)
    si = hsub.add_parser("site", help="a static site: every night's page and every metric's trends, change points "
                                      "and stack changes")
    si.add_argument("--out", required=True, help="the site's directory (index.html, nights/, metrics/)")
    si.add_argument("--db", default=None, help="default nightly-out/history.sqlite")
    si.add_argument("--rebuild", action="store_true",
                    help="render every night's page again (default: only the nights without one)")
    si.set_defaults(func=site)


def _db(args) -> Path:
    return Path(args.db) if args.db else DEFAULT_DB


def site(args) -> int:
    db = _db(args)
    con = store.open_db(db, create=False)  # a bad database is refused before the site's directory is made
    try:
        out = prepare_out_dir(Path(args.out))
        written = history_site.write_site(con, out, args.rebuild)
    finally:
        con.close()
    print(f"{out / 'index.html'}: " + ", ".join(f"{n} {what}" for what, n in written.items()))
    return 0


def ingest(args) -> int:
    if not Path(args.dir).is_dir():
        raise BadInput(f"{args.dir}: not a directory (give a --out directory of harness run / nightly)")
    db = _db(args)
    con = store.open_db(db)
    try:
        added, known = store.ingest(con, Path(args.dir))
        n = store.counts(con)
    finally:
        con.close()
    print(f"{db}: {added} runs added, {known} already there; {n['runs']} runs, {n['figures']} figures in all")
    return 0


def show(args) -> int:
    from datetime import date

    if args.since:
        try:
            date.fromisoformat(args.since)
        except ValueError:
            raise BadInput(f"--since {args.since!r}: give a date YYYY-MM-DD") from None
    db = _db(args)
    con = store.open_db(db, create=False)  # a bad database is refused before the plots directory is made
    try:
        plots = prepare_out_dir(Path(args.plots) if args.plots else db.parent / "history-plots", "--plots")
        text, pngs = history_show.show(con, args.metric, args.case, args.since, plots)
    finally:
        con.close()
    print(text)
    if pngs:
        print(f"trends: {len(pngs)} PNG in {plots}")
    return 0
