"""The report stage's files of a judged run: memray captures a check looked at are deleted when it
passed (nothing to look at) and rendered as a flamegraph when it failed. Checks only name them
(`CheckResult.captures`), so judging has no side effects."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from collections.abc import Iterable

from harness.probes.memory import flamegraph_path


def render_flamegraph(capture: str, leaks: bool = False) -> str:
    """Render memray's flamegraph of a capture next to it (leaks: of what was still allocated at the capture's end);
    '' when done, else why not."""
    proc = subprocess.run([sys.executable, "-m", "memray", "flamegraph", "-f", *(["--leaks"] if leaks else []),
                           "-o", flamegraph_path(capture), capture], capture_output=True, text=True, timeout=120)
    return "" if proc.returncode == 0 else f"memray flamegraph failed: {proc.stderr.strip()[-200:]}"


def finish(checks: Iterable, captures_root: str | None = None) -> list[str]:
    """Delete the captures of passed checks, render the flamegraphs failed checks name; returns a note
    per flamegraph that could not be rendered. captures_root: the run's own captures directory, of which
    only what a failed check names is kept (a case that errored leaves nothing to judge)."""
    notes = []
    checks = list(checks)
    for c in checks:
        captures = c.captures.files
        if not c.failed:
            for capture in captures:
                for f in glob.glob(capture + "*"):  # the capture and its forked children's
                    os.unlink(f)
        elif c.captures.flamegraph_of:
            why = render_flamegraph(c.captures.flamegraph_of, leaks=c.captures.leaks)
            if why:
                notes.append(f"{c.check} {c.case_id}: {why}")
    if captures_root:
        kept = {f for c in checks if c.failed for capture in c.captures.files
                for f in glob.glob(capture + "*")}
        kept |= {flamegraph_path(c.captures.flamegraph_of) for c in checks if c.failed and c.captures.flamegraph_of}
        for folder, _, files in sorted(os.walk(captures_root), key=lambda w: -len(w[0])):  # deepest first
            for f in files:
                if os.path.join(folder, f) not in kept:
                    os.unlink(os.path.join(folder, f))
            if not os.listdir(folder):
                os.rmdir(folder)
    return notes
