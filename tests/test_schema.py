"""Stored files carry a schema version: baseline files and results.json from a newer harness are refused naming the
file and what to do, a file from before versions were stored reads as version 1, and what the harness writes now
carries its version."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from harness import baselines, schema
from harness.errors import BadInput

ENTRY = {"entries": {"tiny/dp4": {"rank0.peak_mib": {"value": 1.0, "tolerance": 0.25, "spread": 0.01, "repeats": 3,
                                                     "values": [1.0, 0.99, 1.0]}}}}


def test_every_committed_baseline_file_carries_the_current_schema():
    files = sorted((Path(__file__).resolve().parents[1] / "baselines").glob("*/*.json"))
    assert files and all(json.loads(p.read_text()).get("schema") == schema.BASELINES for p in files)


def test_a_baseline_file_without_a_schema_reads_as_version_1(tmp_path):
    path = tmp_path / "cpu-gloo" / "golden.json"
    path.parent.mkdir()
    path.write_text(json.dumps(ENTRY))
    assert baselines.load(path)["schema"] == 1


@pytest.mark.parametrize("version, said", [(2, "was written by a newer harness (schema 2; this one reads up to 1): "
                                               "upgrade the harness"),
                                           ("one", "has an unknown schema 'one' (this harness writes 1); re-record")])
def test_a_baseline_file_of_a_newer_or_unknown_schema_is_refused(tmp_path, version, said):
    path = tmp_path / "golden.json"
    path.write_text(json.dumps({**ENTRY, "schema": version}))
    with pytest.raises(BadInput, match=re.escape(f"baseline file {path} {said}")):
        baselines.load(path)


def test_a_recording_writes_the_schema(tmp_path):
    path = tmp_path / "cpu-gloo" / "golden.json"
    baselines.write(path, "golden", "cpu-gloo", ENTRY["entries"], {"date": "today"})
    assert json.loads(path.read_text())["schema"] == schema.BASELINES


def test_a_results_file_of_a_newer_schema_is_refused_by_reports_and_history(tmp_path):
    from harness.history.store import ingest, open_db
    from harness.report.runs import load_runs

    run = tmp_path / "run" / "results.json"
    run.parent.mkdir()
    run.write_text(json.dumps({"schema": 3, "suite": "golden", "engine": "mcore", "model": "tiny", "world_size": 4,
                               "cases": [], "checks": [], "date": "2026-11-29", "judged": True}))
    with pytest.raises(BadInput, match="results file .*results.json was written by a newer harness \\(schema 3"):
        load_runs(tmp_path)
    with pytest.raises(BadInput, match="was written by a newer harness"):
        ingest(open_db(tmp_path / "history.db"), tmp_path)
