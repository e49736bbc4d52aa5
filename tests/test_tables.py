"""The small shared pieces: tables (harness.tables), atomic writes (harness.files), /proc (harness.probes.proc)."""

from __future__ import annotations

import os
import stat

import pytest

from harness.files import atomic_dir, atomic_write
from harness.tables import markdown_table, table

# -- tables -------------------------------------------------------------------------------------

def test_table_aligns_columns_and_underlines_the_header():
    text = table(["case", "outcome", "wall s"], [["tp2-pp1-cp1-dp2", "pass", 3.0], ["a", "regression", None]])
    assert text.split("\n") == [
        "case             outcome     wall s",
        "---------------  ----------  ------",
        "tp2-pp1-cp1-dp2  pass        3.0",
        "a                regression  None",
    ]


def test_table_keeps_cells_as_given_and_aligns_on_request():
    text = table(["rank", "figure"], [[0, "0012"], [12, "1e-05"]], align=">>")
    assert text.split("\n") == ["rank  figure", "----  ------", "   0    0012", "  12   1e-05"]


def test_table_without_rows_is_the_header_and_its_underline():
    assert table(["a", "bb"], []) == "a  bb\n-  --"


def test_table_refuses_an_align_of_the_wrong_length():
    with pytest.raises(ValueError, match="align has 1 entries for 2 columns"):
        table(["a", "b"], [], align="<")


def test_markdown_table_escapes_pipes_and_newlines():
    text = markdown_table(["run", "pass", "reason"], [["r1", 15, "a|b\nc"], ["r2", 0, ""]])
    lines = text.split("\n")
    assert lines[0] == "| run | pass | reason |"
    assert set(lines[1]) <= {"|", "-"}
    assert lines[2] == "| r1 | 15 | a\\|b c |"
    assert lines[3] == "| r2 | 0 |  |"


# -- atomic writes ------------------------------------------------------------------------------

def test_atomic_write_text_and_bytes_and_keeps_the_mode(tmp_path):
    path = tmp_path / "sub" / "f.json"
    atomic_write(path, "é\n")
    assert path.read_bytes() == "é\n".encode()
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    path.chmod(0o600)
    atomic_write(path, b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01" and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert os.listdir(path.parent) == ["f.json"]


def test_a_failed_atomic_write_keeps_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "f.txt"
    path.write_text("old")
    with pytest.raises(TypeError):
        atomic_write(path, 42)  # type: ignore[arg-type]
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["f.txt"]


def test_atomic_dir_replaces_the_whole_directory_or_nothing(tmp_path):
    path = tmp_path / "adapter"
    with atomic_dir(path) as tmp:
        (tmp / "a").write_text("1")
    assert sorted(os.listdir(path)) == ["a"]
    with atomic_dir(path) as tmp:
        (tmp / "b").write_text("2")
    assert sorted(os.listdir(path)) == ["b"] and os.listdir(tmp_path) == ["adapter"]
    with pytest.raises(RuntimeError, match="half"):
        with atomic_dir(path) as tmp:
            (tmp / "c").write_text("3")
            raise RuntimeError("half written")
    assert sorted(os.listdir(path)) == ["b"] and os.listdir(tmp_path) == ["adapter"]


# -- /proc --------------------------------------------------------------------------------------

def test_status_field_reads_bytes_of_this_process_and_of_a_pid():
    from harness.probes import proc

    rss = proc.status_field("self", "VmRSS")
    assert rss > 1024 * 1024 and rss % 1024 == 0
    assert proc.status_field(os.getpid(), "VmHWM") >= rss // 2
    assert isinstance(proc.reset_peak_rss(), bool)
    assert proc.thread_count() >= 1


def test_status_field_failures_raise_measurement_error_with_the_reason():
    from harness.probes import memory, proc

    assert memory.MeasurementError is proc.MeasurementError
    with pytest.raises(proc.MeasurementError, match=r"^/proc/self/status has no VmNothing line$"):
        proc.status_field("self", "VmNothing")
    with pytest.raises(proc.MeasurementError, match=r"^cannot read VmRSS from /proc/999999999/status: "):
        proc.status_field(999999999, "VmRSS")


def test_worker_rank_figures_are_nan_where_proc_has_no_field():
    import math

    from harness.launch import worker

    assert worker._status_mib("VmRSS") > 1
    assert math.isnan(worker._status_mib("VmNothing"))
