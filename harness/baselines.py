"""Stored baselines: baselines/<platform>/<stack>/<suite>.json for figures recorded per stack (memory peaks, step
times: harness.stack.key names the stack), baselines/<platform>/<suite>.json for figures that must hold across
stacks (numerics: SuiteSpec.stack_bound), compared with a per-metric tolerance. A case whose entry the running
stack's file lacks is judged against another stack's entry, naming what differs between the stacks.

File layout: {"schema" (harness/schema.py), "suite", "platform", "entries": {case_key: {metric: {"value",
"tolerance", "spread", "repeats", "values"}}, "provenance": {case_key: {...versions, date, commit}}}}. Recording writes
atomically and returns the diff against the previous file.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from harness import schema, stack
from harness.checks import CheckData
from harness.errors import BadInput
from harness.files import atomic_write, locked_dir
from harness.selection import bisect_command, record_command
from harness.suite_registry import spec_of

DEFAULT_DIR = Path(__file__).resolve().parents[1] / "baselines"
# --baselines-dir, declared once: the commands that judge against or record baseline files (run, baselines, bisect,
# torchrun) and the pytest options of suites/ (suites/conftest.py)
BASELINES_DIR_FLAG: dict = dict(default=None, help="the directory of the baseline files, <platform>/<suite>.json "
                                                   "(default: the repository's baselines/)")


def baseline_path(baselines_dir: Path | str | None, platform: str, suite: str, stack_key: str | None = None) -> Path:
    """The file a suite records into on a platform: under the stack's directory where its figures are recorded per
    stack (stack_key, harness.stack.key()), else the platform's."""
    base = Path(baselines_dir or DEFAULT_DIR) / platform
    return (base / stack_key if stack_key else base) / f"{suite}.json"


def suite_path(baselines_dir: Path | str | None, platform: str, suite: str) -> Path:
    """The file this stack records the suite's figures into (its stack's for a stack-bound suite)."""

    return baseline_path(baselines_dir, platform, suite, stack.key() if spec_of(suite).stack_bound else None)


@dataclass(frozen=True)
class Source:
    """Where a case's baseline entry is read from: a file and its data; `across` lists what differs between the
    stack that recorded the entry and this one (empty: recorded here, or a figure that holds across stacks)."""

    path: Path
    data: dict[str, Any]
    across: tuple[str, ...] = ()

    @property
    def platform(self) -> str:
        """The platform directory the file lies under (its stack's directory, where it has one, in between)."""
        return self.path.parent.parent.name if _is_stack_dir(self.path.parent.name) else self.path.parent.name


class Book:
    """A suite's baseline files on a platform, each read once: this stack's (or the one shared across stacks) and,
    for a stack-bound suite, the other stacks' - a case this stack has not recorded is judged against the newest
    other recording of it. Corrupt files are refused when the book is opened (before any rank starts)."""

    def __init__(self, baselines_dir: Path | str | None, platform: str, suite: str):
        self.suite, self.path = suite, suite_path(baselines_dir, platform, suite)
        self.data = load(self.path)
        self.others: list[tuple[Path, dict[str, Any]]] = []
        self.stack_bound = spec_of(suite).stack_bound
        if self.stack_bound:
            base = Path(baselines_dir or DEFAULT_DIR) / platform
            # every stack's directory, and a file from before stacks had one (its provenance names its stack)
            found = [p for p in (base / f"{suite}.json", *base.glob(f"*/{suite}.json"))
                     if p.exists() and p != self.path]
            self.others = sorted(((p, load(p)) for p in found), key=lambda pd: _newest(pd[1]), reverse=True)

    def source(self, key: str) -> Source:
        if key in self.data.get("entries", {}):
            if self.stack_bound:  # this stack's own recording
                return Source(self.path, self.data)
            # a file shared across stacks: what differs between the stack that recorded the entry and this one
            recorded = self.data.get("provenance", {}).get(key)
            return Source(self.path, self.data, tuple(stack.differences(recorded)) if recorded else ())
        for path, data in self.others:
            if key in data.get("entries", {}):
                recorded = data.get("provenance", {}).get(key)
                return Source(path, data, tuple(stack.differences(recorded)) if recorded else
                              ("a stack its file does not name",))
        return Source(self.path, self.data)


def _is_stack_dir(name: str) -> bool:
    return name.startswith("py") and "-mcore" in name


def _newest(data: dict[str, Any]) -> str:
    return max((p.get("date", "") for p in data.get("provenance", {}).values()), default="")


def across_note(src: Source, case: Any, moved: bool, record: str = "") -> str:
    """What a verdict against an entry recorded on another stack adds to its message: the components that differ;
    where a figure moved, the bisect over the megatron-core (or bridge) releases between and, for a stack-bound suite,
    the command that records this stack's own entry (`record`: the suite's own, else the case's selection's)."""
    if not src.across:
        return ""

    if not moved:
        return f"; against the baseline of another stack ({', '.join(src.across)})"
    said = f"; judged against another stack's baseline ({src.path.parent.name}): moved with {', '.join(src.across)}"
    bisect = [bisect_command(case, dist, a, b) for dist, a, b in _bisectable(src.across)]
    if bisect:
        said += f"; find the release with `{bisect[0]}`"
    if spec_of(case.suite).stack_bound:
        said += f"; record this stack's with `{record or record_command(case)}`"
    return said


def _bisectable(across: tuple[str, ...]) -> list[tuple[str, str, str]]:
    """(distribution, before, after) of the differences a bisect can walk (releases of a package, not Python)."""
    out = []
    for item in across:
        name, _, change = item.partition(" ")
        before, _, after = change.partition(" -> ")
        if name in ("megatron-core", "megatron-bridge", "mbridge") and before != "none" and after != "none":
            out.append((name, before, after))
    return out


def load(path: Path) -> dict[str, Any]:
    """The baseline file, {} when absent; BadInput naming the file and the fix when corrupt."""
    if not path.exists():
        return {}
    return parse(path.read_text(), str(path))


def parse(text: str, source: str) -> dict[str, Any]:
    """A baseline file's content, validated; BadInput naming the source and the fix when corrupt."""
    try:
        data = json.loads(text)
        if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
            raise ValueError("no 'entries' object")
        for metrics in data["entries"].values():
            for m in metrics.values():
                float(m["value"]), float(m["tolerance"])
    except (ValueError, KeyError, TypeError) as exc:
        restore = f"restore it from git (git checkout -- {source}) or " if _tracked(source) else ""
        raise BadInput(f"baseline file {source} is corrupt ({exc}); {restore}re-record it with "
                       "`harness baselines record`, or give another --baselines-dir") from None
    return schema.checked(data, schema.BASELINES, "baseline file", source,
                          "re-record it with `harness baselines record`, or give another --baselines-dir")


def _tracked(source: str) -> bool:
    """Whether git tracks the file (a baseline file read from disk, not a revision's text)."""
    import subprocess

    path = Path(source)
    if not path.is_file():
        return False
    try:
        return subprocess.run(["git", "ls-files", "--error-unmatch", path.name], cwd=path.parent,
                              capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


class BaselineStatus(StrEnum):
    """A figure against its baseline: within tolerance, above it, below it, or not recorded."""

    PASS = "pass"
    REGRESSION = "regression"
    IMPROVEMENT = "improvement"
    MISSING = "missing"


@dataclass(frozen=True)
class Verdict:
    status: BaselineStatus
    measured: float
    baseline: float | None = None
    tolerance: float | None = None

    @property
    def delta(self) -> float:
        return self.measured - (self.baseline or 0.0)


@dataclass
class BaselineFigures(CheckData):
    """What a baseline check judged: the entry's key and each metric's verdict (measured, baseline, tolerance)."""

    key: str
    metrics: dict[str, Verdict]


def compare(data: dict[str, Any], key: str, metric: str, measured: float, floor: float = 0.0) -> Verdict:
    """A NaN / Inf measurement is a regression: `measured > value + tol` is False for NaN. floor: the least
    tolerance, whatever the recorded one."""
    entry = data.get("entries", {}).get(key, {}).get(metric)
    if entry is None:
        return Verdict(BaselineStatus.MISSING, measured)
    value, tol = float(entry["value"]), max(float(entry["tolerance"]), floor)
    if not math.isfinite(measured) or measured > value + tol:
        return Verdict(BaselineStatus.REGRESSION, measured, value, tol)
    if measured < value - tol:
        return Verdict(BaselineStatus.IMPROVEMENT, measured, value, tol)
    return Verdict(BaselineStatus.PASS, measured, value, tol)


# The tolerance scales with the metric (REL_TOLERANCE of its median): a writer peak of 0.3 MiB and a
# gathered 160 MiB are judged at the same relative resolution. ABS_FLOOR is measurement resolution only:
# in baselines/cpu-gloo/py3.11-torch2.13.0-cpu-mcore0.16.1/ckpt-memory.json (3 repeats, memray tracing Python
# allocators) writer peaks spread <= 0.045 MiB and heap peaks <= 0.07 MiB on warm ranks; the first measured save of
# a process adds
# 0.13-0.39 MiB (inside 20% of its 1.4-86 MiB peak). Hence 0.25 MiB: a floor much above that would let a
# writer peak of 0.1-0.3 MiB grow several times over before a regression showed.
REL_TOLERANCE = 0.20
ABS_FLOOR = 0.25


def allowed_tolerance(median: float, rel: float = REL_TOLERANCE, floor: float = ABS_FLOOR) -> float:
    """The tolerance policy of a metric: max(rel x its median, floor). A metric whose repeats spread
    wider than this cannot be baselined: its own repeats would fail against each other.

    The spread of 3 repeats underestimates rare outliers: 5 reruns of ckpt-memory showed one rank
    of a fully_reshardable save at +13% over its 3-repeat median, hence the 20% relative floor.
    """
    return max(rel * abs(median), floor)


def tolerance_for(values: list[float], floor: float = ABS_FLOOR) -> float:
    """max(4 x the spread over repeats, the metric's allowed tolerance)."""
    return max(4 * (max(values) - min(values)), allowed_tolerance(statistics.median(values), floor=floor))


def noisy_metrics(samples: dict[str, dict[str, list[float]]], floor_of=None) -> list[str]:
    """One line per metric whose spread over repeats exceeds its allowed tolerance (or that is not finite);
    floor_of(metric): a metric's absolute floor where it is not ABS_FLOOR."""
    out = []
    for key, metrics in sorted(samples.items()):
        for name, values in sorted(metrics.items()):
            if not all(math.isfinite(v) for v in values):
                out.append(f"{key} {name}: non-finite values {values}")
                continue
            floor = floor_of(name) if floor_of else ABS_FLOOR
            spread, allowed = max(values) - min(values), allowed_tolerance(statistics.median(values), floor=floor)
            if spread > allowed:
                out.append(f"{key} {name}: spread {spread:.3f} over {len(values)} repeats > tolerance {allowed:.3f} "
                           f"(values {', '.join(f'{v:.3f}' for v in values)})")
    return out


def build_entries(samples: dict[str, dict[str, list[float]]], tolerance=None,
                  raw: dict[str, dict[str, list[float]]] | None = None, digits: int | None = 3
                  ) -> dict[str, dict[str, dict]]:
    """{key: {metric: [values over repeats]}} -> baseline entries. tolerance(metric, values): a suite's
    own policy (default tolerance_for); raw: per-sample figures stored beside their metric ("samples");
    digits: decimals kept (None: full precision, for figures judged at 1e-5 relative)."""
    def r(v: float) -> float:
        return v if digits is None else round(v, digits)

    out: dict[str, dict[str, dict]] = {}
    for key, metrics in sorted(samples.items()):
        out[key] = {}
        for name, values in sorted(metrics.items()):
            tol = tolerance(name, values) if tolerance else tolerance_for(values)
            out[key][name] = {"value": r(statistics.median(values)), "spread": r(max(values) - min(values)),
                              "tolerance": r(tol), "repeats": len(values), "values": [r(v) for v in values]}
            if raw and name in raw.get(key, {}):
                out[key][name]["samples"] = [r(v) for v in raw[key][name]]
    return out


def diff_entries(old: dict, new: dict, removed: bool = False) -> str:
    """Readable changes from one set of entries to another ('+' added, '~' changed, '-' removed)."""
    lines = []
    for key, metrics in sorted(new.items()):
        for name, m in sorted(metrics.items()):
            before = old.get(key, {}).get(name)
            if before is None:
                lines.append(f"+ {key} {name}: {m['value']} (tolerance {m['tolerance']}, spread {m['spread']})")
            elif before["value"] != m["value"] or before["tolerance"] != m["tolerance"]:
                rel = f", {(m['value'] - before['value']) / before['value']:+.1%}" if before["value"] else ""
                lines.append(f"~ {key} {name}: {before['value']} -> {m['value']} "
                             f"({m['value'] - before['value']:+.3f}{rel}; "
                             f"tolerance {before['tolerance']} -> {m['tolerance']})")
    if removed:
        for key, metrics in sorted(old.items()):
            lines += [f"- {key} {name}: {m['value']}" for name, m in sorted(metrics.items())
                      if name not in new.get(key, {})]
    return "\n".join(lines) or "(no change)"


def write(path: Path, suite: str, platform: str, entries: dict, provenance: dict) -> str:
    """Merge entries into the file atomically, another recording into the same directory waiting its turn;
    return a readable diff of what changed."""
    with locked_dir(path.parent):
        old = load(path)
        data = {"schema": schema.BASELINES, "suite": suite, "platform": platform,
                "entries": {**old.get("entries", {}), **entries},
                "provenance": {**old.get("provenance", {}), **{k: provenance for k in entries}}}
        atomic_write(path, json.dumps(data, indent=1, sort_keys=True) + "\n")
    return diff_entries(old.get("entries", {}), entries)


def load_at_revision(path: Path, rev: str) -> dict[str, Any]:
    """The baseline file as committed at a git revision ({} if it did not exist there)."""
    import subprocess

    path = path.resolve()
    top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=path.parent, capture_output=True, text=True)
    if top.returncode != 0:
        raise BadInput(f"{path} is not in a git checkout; compare two files with --old FILE instead")
    rel = path.relative_to(Path(top.stdout.strip()).resolve())
    shown = subprocess.run(["git", "show", f"{rev}:{rel}"], cwd=path.parent, capture_output=True, text=True)
    if shown.returncode != 0:
        if "exists on disk, but not in" in shown.stderr or "does not exist in" in shown.stderr:
            return {}
        raise BadInput(f"cannot read {rel} at revision {rev!r}: {shown.stderr.strip().splitlines()[-1]}")
    return parse(shown.stdout, f"{rel}@{rev}")
