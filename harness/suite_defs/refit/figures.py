"""refit's baselined figures: each rank's export peak per bucket size, the key it is stored under, and its policy."""

from __future__ import annotations

from harness import selection
from harness.backends import Backend
from harness.launch.results import CaseResult
from harness.probes.memory import MIB
from harness.spec import Case
from harness.suite_defs.refit.params import RefitParams, size_text
from harness.suite_defs.refit.payload import RefitRankData

# The least tolerance of an export peak: the figures are memray's heap high-water marks, repeatable to a few KiB on
# gloo ranks; a bucket kept alive per refit of `tiny` is 330 KiB.
FLOOR_MIB = 32 / 1024


def key(case: Case) -> str:
    """The case's entry in baselines/<platform>/refit.json (a path's own entry: each export is its own code)."""

    variant = case.params.variant if isinstance(case.params, RefitParams) else ""
    return f"{case.model.name}{'+' + variant if variant else ''}/{case.layout.id}/{case.options.dtype}/{case.engine}"


def record_command(case: Case) -> str:
    """The case's record command: its selection, its variant and bucket sizes (the metrics' names)."""
    import shlex

    p = case.params if isinstance(case.params, RefitParams) else RefitParams()
    extra = ["--refit-variant", p.variant] if p.variant else []
    if p.bucket_sizes != RefitParams().bucket_sizes:
        extra += [a for size in p.bucket_sizes for a in ("--bucket-size", size)]
    return " ".join([selection.record_command(case, skip=("steps",), params=False), *map(shlex.quote, extra)])


def samples(result: CaseResult) -> dict[str, float]:
    """Per rank and bucket size, MiB: the export's host peak (memray's heap high-water; on GPU ranks the device's
    allocated peak above the export's start)."""

    out = {}
    for r in result.ranks:
        for e in r.payload_as(RefitRankData).exports:
            peak = e.peak.device_peak if result.case.backend == Backend.NCCL else e.peak.host_peak
            out[f"rank{r.rank}.export_mib@{size_text(e.bucket_bytes).replace(' ', '')}"] = peak / MIB
    return out
