"""The history database: one row per (run, case, metric) figure, runs keyed by the digest of their
results.json, so ingesting the same results twice adds nothing.

Schema version 1 (table `meta`, key `schema_version`). A database of another version is refused with
what to do; a file that is not a readable SQLite database is refused and never overwritten.
"""

from __future__ import annotations

import hashlib
import json
import math
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import schema
from harness.errors import BadInput

SCHEMA_VERSION = 1
DEFAULT_DB = Path("nightly-out") / "history.sqlite"
_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE runs (
    id INTEGER PRIMARY KEY, digest TEXT NOT NULL UNIQUE, date TEXT NOT NULL, suite TEXT NOT NULL,
    model TEXT NOT NULL, world_size INTEGER NOT NULL, platform TEXT NOT NULL, engine TEXT NOT NULL,
    engine_dist TEXT, engine_version TEXT, label TEXT, harness_commit TEXT, versions TEXT NOT NULL,
    verdict TEXT, path TEXT NOT NULL);
CREATE TABLE figures (
    run_id INTEGER NOT NULL REFERENCES runs(id), case_id TEXT NOT NULL, metric TEXT NOT NULL, value REAL NOT NULL,
    PRIMARY KEY (run_id, case_id, metric));
CREATE TABLE outcomes (
    run_id INTEGER NOT NULL REFERENCES runs(id), case_id TEXT NOT NULL, outcome TEXT NOT NULL, reason TEXT,
    PRIMARY KEY (run_id, case_id));
"""
_SQLITE_MAGIC = b"SQLite format 3\x00"


@dataclass(frozen=True)
class Point:
    """One night's figure of one case."""

    date: str
    value: float
    run_id: int
    versions: dict[str, str]
    label: str | None


def open_db(path: Path, create: bool = True) -> sqlite3.Connection:
    """The database at path (created with the current schema when absent and `create`); BadInput for a
    file that is not a harness history database of this schema version."""
    path = Path(path)
    if path.exists():
        with open(path, "rb") as f:
            head = f.read(len(_SQLITE_MAGIC))  # the header only: a history grows with every night
        if head != _SQLITE_MAGIC:
            raise BadInput(f"history database {path} is not an SQLite database (corrupt or truncated); it was left "
                           "as it is: move it away or give --db another path")
    elif not create:
        raise BadInput(f"history database {path} does not exist: run `harness history ingest DIR --db {path}` first")
    else:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise BadInput(f"--db {path}: cannot create its directory ({exc.strerror or exc}); "
                           f"give a writable path") from None
    try:
        con = sqlite3.connect(str(path))
    except sqlite3.Error as exc:
        raise BadInput(f"--db {path}: cannot open it ({exc}); give a writable path") from None
    try:
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if not tables:
            if not create:
                raise BadInput(f"history database {path} is empty")
            with con:
                con.executescript(_SCHEMA)
                con.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            return con
        if "meta" not in tables:
            raise BadInput(f"{path} is an SQLite database but not a harness history (no meta table); "
                           f"give --db another path")
        row = con.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        version = int(row[0]) if row else 0
        if version != SCHEMA_VERSION:
            newer = version > SCHEMA_VERSION
            raise BadInput(f"history database {path} has schema version {version}, this harness reads version "
                           f"{SCHEMA_VERSION}: " + ("upgrade the harness" if newer else
                                                    "re-ingest the results directories into a new --db"))
        problem = con.execute("PRAGMA quick_check").fetchone()[0]
        if problem != "ok":
            raise BadInput(f"history database {path} is corrupt ({problem}); it was left as it is: move it away "
                           "or give --db another path")
        return con
    except sqlite3.DatabaseError as exc:
        con.close()
        raise BadInput(f"history database {path} is corrupt ({exc}); it was left as it is: move it away or give "
                       "--db another path") from None
    except BaseException:
        con.close()
        raise


def figures(case: dict[str, Any], checks: list[dict[str, Any]]) -> Iterator[tuple[str, float]]:
    """(metric, value) of a case in results.json: its baselined samples, its numeric metrics (a list per
    rank becomes `name.rankN`), and the value each check judged (`check:<name>`)."""
    for name, value in (case.get("samples") or {}).items():
        if isinstance(value, (int, float)) and math.isfinite(value):
            yield name, float(value)
    for name, value in (case.get("metrics") or {}).items():
        if isinstance(value, bool):
            continue
        if isinstance(value, (int, float)) and math.isfinite(value):
            yield name, float(value)
        elif isinstance(value, list) and value and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                       for v in value):
            for i, v in enumerate(value):
                if math.isfinite(v):
                    yield f"{name}.rank{i}", float(v)
    seen = set()
    for c in checks:
        if c.get("case_id") == case["id"] and isinstance(c.get("value"), (int, float)) and c["check"] not in seen:
            seen.add(c["check"])  # a check that ran twice for a case keeps its first figure
            if math.isfinite(c["value"]):
                yield f"check:{c['check']}", float(c["value"])


def ingest(con: sqlite3.Connection, root: Path) -> tuple[int, int]:
    """Every judged results.json below root into the database, in one transaction; (runs added, runs
    already there)."""
    added = known = 0
    files = sorted(Path(root).rglob("results.json"))
    with con:
        for path in files:
            raw = path.read_bytes()
            try:
                data = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise BadInput(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}); "
                               f"nothing was ingested") from None
            if isinstance(data, dict):
                data = schema.checked(data, schema.RESULTS, "results file", str(path), "nothing was ingested")
            if not data.get("judged", True) or "date" not in data:
                continue  # written while its run went on (the final file replaces it), or a run that judged nothing
            digest = hashlib.sha256(raw).hexdigest()
            if con.execute("SELECT 1 FROM runs WHERE digest=?", (digest,)).fetchone():
                known += 1
                continue
            versions = data.get("versions", {})
            engine = data.get("engine_dist") or {}
            cur = con.execute(
                "INSERT INTO runs (digest, date, suite, model, world_size, platform, engine, engine_dist, "
                "engine_version, label, harness_commit, versions, verdict, path) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (digest, data["date"], data["suite"], data["model"], data["world_size"], data.get("platform", "?"),
                 data["engine"], engine.get("name"), engine.get("version"), data.get("label"),
                 versions.get("harness_commit"), json.dumps(versions, sort_keys=True), data.get("verdict"), str(path)))
            run_id = cur.lastrowid
            for case in data.get("cases", []):
                con.execute("INSERT OR IGNORE INTO outcomes VALUES (?,?,?,?)",
                            (run_id, case["id"], case.get("outcome", case.get("status", "?")), case.get("reason")))
                con.executemany("INSERT OR IGNORE INTO figures VALUES (?,?,?,?)",
                                [(run_id, case["id"], m, v) for m, v in figures(case, data.get("checks", []))])
            added += 1
    return added, known


def series(con: sqlite3.Connection, metric: str, case_glob: str = "*", since: str | None = None
           ) -> dict[tuple[str, str, str], list[Point]]:
    """(platform, run label, case id) -> the metric's points, oldest first. Runs of different labels (another
    configuration of the same cases, e.g. a `--label bf16` night, or another stack run beside it each night:
    `harness nightly --other-stack NAME=PYTHON` labels its runs NAME) are separate series ("" unlabelled): two
    stacks run every night make no change point of their own, and a stack upgraded in place stays one series, its
    night marked (show.stack_changed)."""
    rows = con.execute(
        "SELECT r.platform, f.case_id, r.date, f.value, r.id, r.versions, r.label FROM figures f "
        "JOIN runs r ON r.id = f.run_id WHERE f.metric = ? AND f.case_id GLOB ? AND r.date >= ? "
        "ORDER BY r.date, r.id", (metric, case_glob, since or "")).fetchall()
    out: dict[tuple[str, str, str], list[Point]] = {}
    for platform, case_id, date, value, run_id, versions, label in rows:
        out.setdefault((platform, label or "", case_id), []).append(Point(date, value, run_id, json.loads(versions),
                                                                          label))
    return out


def metrics(con: sqlite3.Connection) -> list[str]:
    return [r[0] for r in con.execute("SELECT DISTINCT metric FROM figures ORDER BY metric")]


def counts(con: sqlite3.Connection) -> dict[str, int]:
    return {t: con.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in ("runs", "figures", "outcomes")}
