"""The report stage's files of a judged run: memray captures a check looked at are deleted when it
passed (nothing to look at) and rendered as a flamegraph when it failed. Checks only name them
(`CheckResult.data["captures"]`, `["flamegraph_of"]`), so judging has no side effects."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from collections.abc import Iterable


def flamegraph_path(capture: str) -> str:
    """Where the report stage renders the flamegraph of a memray capture."""
    return capture.replace(".bin", ".html") if capture else "(no capture)"


def render_flamegraph(capture: str) -> str:
    """Render memray's flamegraph of a capture next to it; '' when done, else why not."""
    proc = subprocess.run([sys.executable, "-m", "memray", "flamegraph", "-f", "-o", flamegraph_path(capture), capture],
                          capture_output=True, text=True, timeout=120)
    return "" if proc.returncode == 0 else f"memray flamegraph failed: {proc.stderr.strip()[-200:]}"


def finish(checks: Iterable) -> list[str]:
    """Delete the captures of passed checks, render the flamegraphs failed checks name; returns a note
    per flamegraph that could not be rendered."""
    notes = []
    for c in checks:
        captures = c.data.get("captures") or []
        if not c.failed:
            for capture in captures:
                for f in glob.glob(capture + "*"):  # the capture and its forked children's
                    os.unlink(f)
        elif c.data.get("flamegraph_of"):
            why = render_flamegraph(c.data["flamegraph_of"])
            if why:
                notes.append(f"{c.check} {c.case_id}: {why}")
    return notes
