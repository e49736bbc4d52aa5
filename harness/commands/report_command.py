"""`harness report`: results directories as Markdown, JSON, JUnit XML and PNG plots."""

from __future__ import annotations

from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("report", help="render results directories as Markdown, JSON, JUnit XML and PNG plots")
    p.add_argument("dir", help="a --out directory of `harness run` (every results.json below it is included)")
    p.set_defaults(func=main)


def main(args) -> int:
    from harness.report.directory import prepare_out_dir, write_report
    from harness.report.runs import load_runs

    load_runs(Path(args.dir))  # a directory with readable results, before anything is written
    prepare_out_dir(Path(args.dir), "DIR")
    written = write_report(Path(args.dir))
    for kind, path in written.items():
        print(f"{kind}: {path}")
    return 0
