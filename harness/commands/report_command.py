"""`harness report`: results directories as an HTML page, Markdown, JSON, JUnit XML and PNG plots."""

from __future__ import annotations

from pathlib import Path

from harness.errors import BadInput
from harness.history import nights, store
from harness.report import directory
from harness.report.directory import prepare_out_dir
from harness.report.runs import load_runs


def add_parser(sub) -> None:
    p = sub.add_parser("report", help="render results directories as an HTML page, Markdown, JSON, JUnit XML and "
                                      "PNG plots")
    p.add_argument("dir", help="a --out directory of `harness run` (every results.json below it is included)")
    p.add_argument("--history-db", default=None,
                   help="history database of the earlier nights: the page says what is new since them (default: "
                        "DIR/history.sqlite where it exists, as `harness nightly` writes it)")
    p.set_defaults(func=main)


def main(args) -> int:
    load_runs(Path(args.dir))  # a directory with readable results, before anything is written
    db = Path(args.history_db) if args.history_db else Path(args.dir) / "history.sqlite"
    if args.history_db and not db.exists():
        raise BadInput(f"--history-db {db} does not exist: give the database `harness nightly` or `harness history "
                       f"ingest` wrote, or leave the flag out")
    # a corrupt or foreign database is refused before anything is written
    con = store.open_db(db, create=False) if db.exists() else None
    try:
        prepare_out_dir(Path(args.dir), "DIR")
        written = directory.write_report(Path(args.dir), (lambda runs: nights.compare(con, runs)) if con else None)
    finally:
        if con is not None:
            con.close()
    for kind, path in written.items():
        print(f"{kind}: {path}")
    return 0
