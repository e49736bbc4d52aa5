"""Judges of ckpt-memory's save cases: the format on disk, the analytic memory band, the baselines."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from harness import baselines
from harness import platform as harness_platform
from harness.backends import Backend
from harness.checks import Captures, CheckResult, cannot_tell, case_failed
from harness.checks.memory_model import LOAD_FIXED_COST, discrimination, gathers, rival, save_band
from harness.ckpt_formats import CkptFormat
from harness.launch.results import CaseResult
from harness.probes.ckpt_format import EXPECTED_ON_DISK
from harness.probes.memory import MIB, flamegraph_path
from harness.probes.retention import Retention
from harness.suite_defs.ckpt_memory import figures
from harness.suite_defs.ckpt_memory.figures import key as key_of
from harness.suite_defs.ckpt_memory.figures import record_command, save_data
from harness.suite_defs.ckpt_memory.params import SUITE, CkptMemoryParams

if TYPE_CHECKING:
    from harness.baselines import Source, Verdict


EXPECTED_DEFAULT = "dp_reshardable"  # Megatron-LM / Megatron-Bridge default since R1
EXPECTED_DEFAULTS = {"default": EXPECTED_DEFAULT, "fsdp2_default": "fsdp2_sharded"}


def check(results: list[CaseResult], params: CkptMemoryParams) -> list[CheckResult]:
    """Every save case: contract, model band, retained memory, baseline; every contract case (check_reshard
    judges its loads' values and bands): its loads' peaks against the baseline."""

    out: list[CheckResult] = []
    books: dict[str, baselines.Book] = {}
    for res in results:
        case = res.case
        if case.params.ckpt_role and not res.ok:
            continue  # check_reshard names it
        if not res.ok:
            out.append(case_failed("ckpt-memory.run", res))
            continue
        platform = harness_platform.detect_platform(case.backend).key
        if platform not in books:
            books[platform] = baselines.Book(params.baselines_dir, platform, SUITE)
        source = books[platform].source(key_of(case))
        if case.params.ckpt_role:
            if loads := figures.load_samples(res):
                # the committed GPU files predate the loads' entries: an absent one cannot tell, it does not fail
                # at least a load's fixed cost beside the state: the small loads of tiny models (1.6-2.3 MiB) moved
                # by 0.6 MiB with what ran before them
                out.append(check_baseline("ckpt-memory.load-baseline", res, loads, source,
                                          missing_fails=False, floor=LOAD_FIXED_COST / MIB))
            continue
        out.append(_check_contract(res))
        out.append(_check_model(res))
        out.append(check_retained(res))
        out.append(_check_baseline(res, figures.samples(res), source))
    return out


def labelled_format(res: CaseResult) -> str:
    """The format the engine's own label says (content metadata / the engine's saved_metadata)."""
    meta = next((m for r in res.ranks if (m := save_data(r).content_metadata)), None) or {}
    if "format" in meta:
        return meta["format"]
    sharding = meta.get("distrib_optim_sharding_type", "?")
    if sharding == CkptFormat.FULLY_RESHARDABLE and meta.get("distrib_optim_fully_reshardable_mem_efficient"):
        return "fully_reshardable_mem_efficient"
    return sharding


def _check_contract(res: CaseResult) -> CheckResult:
    """The format asked for against what is on disk (and, for mem_efficient, what the memory shows)."""

    asked = res.case.params.ckpt_format
    expected = EXPECTED_DEFAULTS.get(asked, asked)
    disk = next(d for r in res.ranks if (d := save_data(r).on_disk) is not None)
    label = labelled_format(res)
    what = (f"{res.case.engine} default format (expected {expected})" if asked in EXPECTED_DEFAULTS
            else f"format {asked}")
    rows = [f"on disk: {disk.layout}: {disk.evidence}",
            f"label written by the engine: {label} ({'agrees' if label == expected else 'DISAGREES'}; "
            f"secondary: the files decide)"]
    want = EXPECTED_ON_DISK.get(expected, expected)
    fsdp2 = ("fsdp2_sharded", "fsdp2_full")
    if want in fsdp2 and disk.layout in fsdp2 and res.case.layout.dp * res.case.layout.cp == 1:
        return cannot_tell("ckpt-memory.contract", res.case.id,
                           f"{what}: with one DP rank fsdp2's sharded and full saves write the same files (one DCP "
                           f"writer holding every tensor whole; on disk: {disk.evidence}): needs world size 2 or more",
                           rows)
    if disk.layout != want:
        return CheckResult("ckpt-memory.contract", res.case.id, False,
                           f"{what}: the checkpoint on disk is {disk.layout}, not {want} ({disk.evidence})", rows)
    note = ""
    fully = (CkptFormat.FULLY_RESHARDABLE, CkptFormat.FULLY_RESHARDABLE_MEM_EFFICIENT)
    if want == CkptFormat.FULLY_RESHARDABLE and expected in fully:
        gathered, why = _gathered_off_dp_rank0(res)
        rows.append(f"mem_efficient or not (byte-identical on disk), from the measured peaks: {why}")
        if gathered is not None and gathered != (expected == CkptFormat.FULLY_RESHARDABLE):
            measured = "fully_reshardable" if gathered else "fully_reshardable_mem_efficient"
            return CheckResult("ckpt-memory.contract", res.case.id, False,
                               f"{what}: on disk fully_reshardable, by the measured peaks {measured}: {why}", rows)
        note = f"; mem_efficient: {why}" if gathered is None else f"; by the measured peaks {expected}"
    return CheckResult("ckpt-memory.contract", res.case.id, True,
                       f"{what}: the checkpoint on disk is {disk.layout}{note}", rows)


def _check_model(res: CaseResult) -> CheckResult:
    """Every rank's peak inside the band of the format asked for; says where the band cannot tell
    that format from its rival (12N too small against the fixed cost, or no DP to gather over)."""
    case = res.case
    fmt = EXPECTED_DEFAULTS.get(case.params.ckpt_format, case.params.ckpt_format)
    fp, device = case.params.fully_parallel_save, case.backend == Backend.NCCL
    rows, bad, blind = [], [], []
    judged = [r.rank for r in res.ranks if rival(fmt, case.layout, r.rank, case.model)]  # ranks where a rival exists
    for r in res.ranks:
        band = save_band(fmt, case.model, case.layout, r.rank, fp, device)
        why = discrimination(fmt, case.model, case.layout, r.rank, fp, device)
        save = save_data(r).save
        peak = save.host_peak
        ok = band.contains(peak)
        pinned = f" (pinned staging {save.pinned_peak / MIB:.1f} MiB of it)" if save.pinned_peak else ""
        other = rival(fmt, case.layout, r.rank, case.model)
        rows.append(f"rank {r.rank}: host peak {peak / MIB:.1f} MiB{pinned}, model {band.describe()} "
                    f"{'ok' if ok else 'OUTSIDE'}" + (f" - cannot tell it from {other}" if why else ""))
        if not ok:
            bad.append((r, peak, band))
        if why:
            blind.append((r.rank, why))
    if bad:
        r, peak, band = bad[0]
        return CheckResult("ckpt-memory.model", case.id, False,
                           f"rank {r.rank} save host peak {peak / MIB:.1f} MiB outside the {fmt} model band "
                           f"{band.describe()}", rows)
    if judged and len(blind) == len(judged):
        return cannot_tell("ckpt-memory.model", case.id,
                           f"every rank's peak is inside the {fmt} band, which overlaps its rival's for this model "
                           f"and layout: {blind[0][1]}", rows)
    told = [r for r in judged if r not in dict(blind)]
    return CheckResult("ckpt-memory.model", case.id, True,
                       f"every rank inside the {fmt} band; it rules out the rival format on ranks {told}"
                       + (f" (not on {[b[0] for b in blind]}: 12N too small or D = 1)" if blind else ""), rows)


# What saves of the same state may leave allocated in a rank, per save: megatron's and torch's per-collective
# bookkeeping and lazily built caches. Measured on gloo ranks (3 saves after the measured one): at most 230 KiB per
# save (`small`, fsdp2_sharded, world size 4), 30-130 KiB in megatron's formats, async saves included; once per rank
# process a cache fills over a few saves (1.1 MiB of all_gather outputs on `small` at world size 1, seen in the first
# fully parallel or async fully_reshardable case after other formats' saves): 0.39 MiB per save in that case.
RETAINED_PER_SAVE = 1 * MIB


def check_retained(res: CaseResult) -> CheckResult:
    """What RESAVES saves of the same state left allocated in each rank (memray: allocated during them, live after
    them and the garbage collector) against RETAINED_PER_SAVE; the rank's RSS after each save shown beside it."""
    case, rows = res.case, []
    kept_by_rank: dict[int, Retention] = {}
    for r in res.ranks:
        kept = save_data(r).retention
        if kept is None:
            return cannot_tell("ckpt-memory.retained", case.id, f"rank {r.rank} measured no repeated saves")
        kept_by_rank[r.rank] = kept
        rss = ", ".join(f"{x / MIB:.0f}" for x in kept.rss_after)
        rows.append(f"rank {r.rank}: {kept.saves} saves kept {kept.kept / 1024:.0f} KiB ({kept.per_save / 1024:.0f} "
                    f"KiB per save, {kept.kept_allocations} allocations); RSS MiB before and after each: {rss}")
    rows.append("(RSS is shown, not judged: it holds the allocator's cache of the saves' freed transients, which moved "
                "by up to a save's peak between saves of `small` on gloo ranks while the heap kept 40 KiB per save)")
    rank, kept = max(kept_by_rank.items(), key=lambda item: item[1].per_save)
    files = [k.capture for k in kept_by_rank.values() if k.capture]
    if kept.per_save <= RETAINED_PER_SAVE:
        return CheckResult("ckpt-memory.retained", case.id, True,
                           f"every rank keeps at most {kept.per_save / 1024:.0f} KiB per save (bound "
                           f"{RETAINED_PER_SAVE / MIB:.0f} MiB; rank {rank})", rows, captures=Captures(files))
    site, nbytes, count = kept.top[0] if kept.top else ("(no stack)", kept.kept, kept.kept_allocations)
    return CheckResult("ckpt-memory.retained", case.id, False,
                       f"rank {rank} keeps {kept.per_save / MIB:.1f} MiB per save: {kept.saves} saves of the same "
                       f"state left {kept.kept / MIB:.1f} MiB allocated during them live after them (bound "
                       f"{RETAINED_PER_SAVE / MIB:.0f} MiB per save); most of it, {nbytes / MIB:.1f} MiB in {count} "
                       f"allocations, from {site}; what stayed: {flamegraph_path(kept.capture)}", rows,
                       captures=Captures(files, kept.capture, leaks=True))


def _check_baseline(res: CaseResult, samples: dict[str, float], source: Source) -> CheckResult:
    """A save case's samples (figures.samples) against its entry (figures.key) in the baseline file's data;
    the flamegraph of the rank whose figure moved."""
    files = [save_data(r).save.capture for r in res.ranks if save_data(r).save.capture]
    return check_baseline("ckpt-memory.baseline", res, samples, source, files,
                          lambda metric: save_data(res.ranks[int(metric.split(".")[0][4:])]).save.capture)


def check_baseline(name: str, res: CaseResult, samples: dict[str, float], source: Source,
                   files: list[str] | None = None, capture_of=None, missing_fails: bool = True,
                   floor: float = 0.0) -> CheckResult:
    """A case's figures against its entry in a baseline file's data. A metric the entry lacks (the file
    was recorded before it was measured) cannot be judged and is named; an absent entry fails with the record
    command (missing_fails) or cannot tell (a check newer than the committed files). floor: the least tolerance,
    MiB, whatever the recorded one. An entry recorded on another stack says what differs (baselines.across_note)."""

    data, path = source.data, source.path
    key = key_of(res.case)
    recorded = key in data.get("entries", {})
    rows: list[str] = []
    verdicts: dict[str, Verdict] = {}
    for metric, value in samples.items():
        v = verdicts[metric] = baselines.compare(data, key, metric, value, floor)
        base = "-" if v.baseline is None else f"{v.baseline:.2f} +- {v.tolerance:.2f}"
        rows.append(f"{metric}: {value:.2f} MiB, baseline {base}, delta {v.delta:+.2f} MiB: {v.status}"
                    + (f"; detects {_detects(v)}" if v.baseline is not None else ""))
    shown = baselines.BaselineFigures(key, verdicts)
    by_status = {st: [m for m, v in verdicts.items() if v.status is st] for st in baselines.BaselineStatus}
    # the report stage deletes the captures of a pass and renders the flamegraph of a failure
    captures = Captures(files or [])
    record = record_command(res.case)
    moved_any = bool(by_status[baselines.BaselineStatus.REGRESSION] or by_status[baselines.BaselineStatus.IMPROVEMENT])
    across = baselines.across_note(source, res.case, moved_any, record)
    if moved_any:
        # a regression anywhere outranks improvements elsewhere; a non-finite figure, then the largest delta
        metric = max(by_status[baselines.BaselineStatus.REGRESSION] or by_status[baselines.BaselineStatus.IMPROVEMENT],
                     key=lambda m: (not math.isfinite(verdicts[m].measured), abs(verdicts[m].delta)))
        v = verdicts[metric]
        capture = capture_of(metric) if capture_of else ""
        failed = Captures(files or [], capture)
        flame = f"; flamegraph: {flamegraph_path(capture)}" if capture else ""
        if not math.isfinite(v.measured):
            return CheckResult(name, res.case.id, False,
                               f"{metric} measured {v.measured} MiB (not a finite number) against baseline "
                               f"{v.baseline:.2f} +- {v.tolerance:.2f} MiB{across}{flame}", rows, data=shown,
                               captures=failed)
        verb = ("above" if v.status is baselines.BaselineStatus.REGRESSION
                else "below (improvement: " + ("see below)" if across else f"refresh the baseline with `{record}`)"))
        moved = sum(1 for m in verdicts.values() if m.status in (baselines.BaselineStatus.REGRESSION,
                                                                   baselines.BaselineStatus.IMPROVEMENT))
        also = f" ({moved} figures moved)" if across and moved > 1 else ""
        return CheckResult(name, res.case.id, False,
                           f"{metric} {v.measured:.2f} MiB is {v.delta:+.2f} MiB {verb} baseline "
                           f"{v.baseline:.2f} +- {v.tolerance:.2f} MiB{also}{across}{flame}", rows,
                           improvement=not by_status[baselines.BaselineStatus.REGRESSION], data=shown, captures=failed)
    unrecorded = by_status[baselines.BaselineStatus.MISSING]
    if unrecorded and not recorded:
        message = (f"no baseline for {key} {unrecorded[0]} on platform {source.platform} ({path}); record it "
                   f"with: {record}")
        if missing_fails:
            return CheckResult(name, res.case.id, False, message, rows, data=shown, captures=captures)
        return cannot_tell(name, res.case.id, message, rows, data=shown)
    if unrecorded and not by_status[baselines.BaselineStatus.PASS]:
        return cannot_tell(name, res.case.id, f"{key}'s entry in {path} has none of {', '.join(unrecorded)} "
                                              f"(recorded before they were measured); re-record it with: {record}",
                           rows, data=shown)
    coarsest = max(by_status[baselines.BaselineStatus.PASS], key=lambda m: _relative_tolerance(verdicts[m]),
                   default=None)
    sees = f"; coarsest: {coarsest} detects {_detects(verdicts[coarsest])}" if coarsest else ""
    later = (f"; not judged, recorded before they were measured: {', '.join(unrecorded)} (re-record with `{record}`)"
             if unrecorded else "")
    return CheckResult(name, res.case.id, True, f"within baseline ({key}){sees}{later}{across}", rows, show=True,
                       data=shown, captures=captures)


def _relative_tolerance(v: Verdict) -> float:
    return (v.tolerance or 0.0) / v.baseline if v.baseline else math.inf


def _detects(v: Verdict) -> str:
    """The smallest rise over the baseline that fails, in MiB and relative to the baseline."""
    rel = f" (+{(v.tolerance or 0.0) / v.baseline:.0%})" if v.baseline else ""
    return f"> +{v.tolerance:.2f} MiB{rel}"


def _gathered_off_dp_rank0(res: CaseResult) -> tuple[bool | None, str]:
    """Whether the ranks off DP rank 0 gathered the whole state during the save (fully_reshardable) or
    not (mem_efficient), from their measured peaks against 12N; None where the model cannot tell."""
    mem_eff, case = "fully_reshardable_mem_efficient", res.case
    fp = case.params.fully_parallel_save
    off = [r for r in res.ranks if not gathers(mem_eff, case.layout, r.rank, case.model)]
    if not off and case.layout.dp * case.layout.cp == 1:
        return None, "cannot tell: every rank is a DP rank 0 (D = 1)"
    if not off:
        return None, "cannot tell: every rank is rank 0 of its DP or its expert-DP group, so every rank gathers"
    device = case.backend == Backend.NCCL
    told = [r for r in off if not discrimination(mem_eff, case.model, case.layout, r.rank, fp, device)]
    if not told:
        return None, "cannot tell: " + discrimination(mem_eff, case.model, case.layout, off[0].rank, fp, device)
    s = {r.rank: save_band("fully_reshardable", case.model, case.layout, r.rank, fp, device).low for r in told}
    gathered = [r for r in told if save_data(r).save.host_peak >= s[r.rank]]
    r = (gathered or told)[0]
    peak = save_data(r).save.host_peak / MIB
    if gathered:
        return True, (f"ranks off DP rank 0 gathered the state: rank {r.rank} peak {peak:.1f} MiB >= "
                      f"12N = {s[r.rank] / MIB:.1f} MiB ({len(gathered)} of {len(told)} ranks)")
    return False, (f"ranks off DP rank 0 did not gather: rank {r.rank} peak {peak:.1f} MiB < "
                   f"12N = {s[r.rank] / MIB:.1f} MiB")
