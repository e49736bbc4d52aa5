"""Stored baselines: baselines/<platform>/<suite>.json, compared with a per-metric tolerance.

File layout: {"suite", "platform", "entries": {case_key: {metric: {"value", "tolerance", "spread",
"repeats", "values"}}, "provenance": {case_key: {...versions, date, commit}}}}. Recording writes
atomically and returns the diff against the previous file.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.errors import BadInput

DEFAULT_DIR = Path(__file__).resolve().parents[1] / "baselines"


def baseline_path(baselines_dir: Path | str | None, platform: str, suite: str) -> Path:
    return Path(baselines_dir or DEFAULT_DIR) / platform / f"{suite}.json"


def record_command(suite: str, model: str, world_size: int) -> str:
    return f"harness baselines record --suite {suite} --model {model} --world-size {world_size}"


def load(path: Path) -> dict[str, Any]:
    """The baseline file, {} when absent; BadInput naming the file and the fix when corrupt."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
            raise ValueError("no 'entries' object")
        for metrics in data["entries"].values():
            for m in metrics.values():
                float(m["value"]), float(m["tolerance"])
    except (ValueError, KeyError, TypeError) as exc:
        raise BadInput(f"baseline file {path} is corrupt ({exc}); restore it from git "
                       f"(git checkout -- {path}) or re-record it with `harness baselines record`") from None
    return data


@dataclass(frozen=True)
class Verdict:
    status: str  # pass | regression | improvement | missing
    measured: float
    baseline: float | None = None
    tolerance: float | None = None

    @property
    def delta(self) -> float:
        return self.measured - (self.baseline or 0.0)


def compare(data: dict[str, Any], key: str, metric: str, measured: float) -> Verdict:
    entry = data.get("entries", {}).get(key, {}).get(metric)
    if entry is None:
        return Verdict("missing", measured)
    value, tol = float(entry["value"]), float(entry["tolerance"])
    if measured > value + tol:
        return Verdict("regression", measured, value, tol)
    if measured < value - tol:
        return Verdict("improvement", measured, value, tol)
    return Verdict("pass", measured, value, tol)


def tolerance_for(values: list[float], rel: float = 0.20, floor: float = 2.0) -> float:
    """max(4 x the spread over repeats, rel x the median, floor).

    The spread of 3 repeats underestimates rare outliers: 5 reruns of ckpt-memory showed one rank
    of a fully_reshardable save at +13% over its 3-repeat median, hence the 20% relative floor.
    """
    spread = max(values) - min(values)
    return max(4 * spread, rel * statistics.median(values), floor)


def build_entries(samples: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, dict]]:
    """{key: {metric: [values over repeats]}} -> baseline entries."""
    out: dict[str, dict[str, dict]] = {}
    for key, metrics in sorted(samples.items()):
        out[key] = {}
        for name, values in sorted(metrics.items()):
            out[key][name] = {"value": round(statistics.median(values), 3),
                              "spread": round(max(values) - min(values), 3),
                              "tolerance": round(tolerance_for(values), 3), "repeats": len(values),
                              "values": [round(v, 3) for v in values]}
    return out


def write(path: Path, suite: str, platform: str, entries: dict, provenance: dict) -> str:
    """Merge entries into the file atomically; return a readable diff of what changed."""
    old = load(path)
    data = {"suite": suite, "platform": platform,
            "entries": {**old.get("entries", {}), **entries},
            "provenance": {**old.get("provenance", {}), **{k: provenance for k in entries}}}
    diff = []
    for key, metrics in entries.items():
        for name, m in metrics.items():
            before = old.get("entries", {}).get(key, {}).get(name)
            if before is None:
                diff.append(f"+ {key} {name}: {m['value']} (tolerance {m['tolerance']}, spread {m['spread']})")
            elif before["value"] != m["value"] or before["tolerance"] != m["tolerance"]:
                diff.append(f"~ {key} {name}: {before['value']} -> {m['value']} "
                            f"(tolerance {before['tolerance']} -> {m['tolerance']})")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
    return "\n".join(diff) or "(no change)"


def record_suite(suite_name: str, model: str, world_size: int, layout_ids: list[str] | None = None, *,
                 repeats: int = 3, baselines_dir: str | None = None, **kwargs) -> tuple[Path, str]:
    """Run the suite `repeats` times, store median / spread / tolerance per metric; (path, diff)."""
    import sys

    from harness import report
    from harness.driver import run_suite
    from harness.platform import detect_platform

    if repeats < 3:
        raise BadInput(f"--repeats must be >= 3 so the spread can set the tolerance, got {repeats}")
    samples: dict[str, dict[str, list[float]]] = {}
    suite, backend = None, None
    for i in range(repeats):
        print(f"repeat {i + 1}/{repeats}", file=sys.stderr, flush=True)
        run = run_suite(suite_name, model, world_size, layout_ids, baselines_dir=baselines_dir, **kwargs)
        suite, backend = run.suite, run.backend
        failed = [r for r in run.results if not r.ok]
        if failed:
            raise RuntimeError(f"not recording: case {failed[0].case.id} failed:\n{failed[0].error}")
        for res in run.results:
            for metric, value in suite.samples(res).items():
                samples.setdefault(suite.key(res.case), {}).setdefault(metric, []).append(value)
    platform = detect_platform(backend).key
    path = baseline_path(baselines_dir, platform, suite_name)
    provenance = {**report.versions(), "date": report.now(), "repeats": repeats}
    return path, write(path, suite_name, platform, build_entries(samples), provenance)
