"""`harness compare`: A against B in one run - two engines, or this environment against another
megatron-core release or commit - with the step-perf cases of both run in rounds whose A/B order is
drawn at random each round (randomized multiple interleaved trials), so drift of a shared machine
falls on both sides alike. Per case: the ratio of B's step time to A's over the rounds (one ratio of
medians per round: steps within a round are correlated, rounds are the units) with its t interval and a
paired t-test (harness/checks/timing.py compare_rounds), and every counter that differs. Exit 1 when B is
significantly slower than A beyond the minimum effect on any case, or does other work (exact counters);
exit 5 when some case cannot tell (the interval still reaches beyond the minimum effect) and none failed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from harness.backends import tier_of
from harness.checks.timing import CONFIDENCE, MIN_EFFECT_INTERLEAVED, compare_rounds
from harness.engine_names import EngineName
from harness.errors import BadInput
from harness.files import atomic_write
from harness.outcomes import EXIT_NOTHING_JUDGED, CaseStatus
from harness.platform import resolve_backend
from harness.probes.cpu_share import FOREIGN_LIMIT
from harness.tables import table

if TYPE_CHECKING:
    from harness.driver import Plan
    from harness.selection import CaseSelection


@dataclass
class Side:
    """One side of a comparison: an engine in this process, or a run in another environment."""

    label: str
    engine: str = EngineName.MCORE
    python: str | None = None  # another interpreter (a cached environment of another release)
    pythonpath: list[str] = field(default_factory=list)  # put first on the path (a worktree of a commit)

    @property
    def in_process(self) -> bool:
        return self.python is None and not self.pythonpath


@dataclass
class CaseSamples:
    """What one side measured for one case: a round's step times and exposed communication (step_ms,
    exposed_ms), or, gathered by run_rounds, every round's (rounds_*: the rounds are the units)."""

    step_ms: list[float] = field(default_factory=list)
    exposed_ms: list[float] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=dict)
    rounds_step_ms: list[list[float]] = field(default_factory=list)
    rounds_exposed_ms: list[list[float]] = field(default_factory=list)
    foreign_share: float | None = None  # others' share of the CPUs while the round's steps were timed
    rounds_foreign_share: list[float] = field(default_factory=list)  # of the rounds where it was measured


def side_selection(sel: CaseSelection, engine: str, steps_per_round: int) -> CaseSelection:
    """What a side in this process runs: step-perf's selected cases on its engine, steps_per_round timed steps."""
    return dataclasses.replace(sel, suite="step-perf", engine=engine, suite_params={"timed_steps": steps_per_round})


def plan_sides(sel: CaseSelection, engines: list[str], steps_per_round: int) -> dict[str, Plan]:
    """Each engine's plan, made once, before anything runs (bad input refused here): judged against no baseline
    (a directory that does not exist), as the sides are judged against each other."""
    from harness.driver import plan

    none = str(Path(tempfile.gettempdir()) / f"harness-compare-no-baselines-{os.getpid()}")
    return {e: plan(side_selection(sel, e, steps_per_round), baselines_dir=none) for e in dict.fromkeys(engines)}


def _in_process_round(side: Side, plans: dict[str, Plan], say) -> dict[str, CaseSamples]:
    """One round of a side in this process: its engine's plan, executed again."""
    from harness.driver import execute
    from harness.suite_defs.step_perf import figures

    run = execute(plans[side.engine], progress=say).stop_if_interrupted()
    out = {}
    for r in run.results:
        if not r.ok:
            raise RuntimeError(f"{side.label}: case {r.case.id} failed: {r.error.splitlines()[0] if r.error else ''}")
        load = figures.foreign_load(r)
        out[figures.key(r.case)] = CaseSamples(figures.step_ms(r), figures.exposed_ms(r), figures.counters(r),
                                               foreign_share=load.share if load else None)
    return out


def _subprocess_round(side: Side, sel: CaseSelection, args, workdir: Path, n: int) -> dict[str, CaseSamples]:
    from harness.bisect import step_env
    from harness.suite_defs.step_perf.figures import FOREIGN, NOT_COUNTERS

    out_dir = workdir / f"{side.label.replace('/', '_')}-{n}"
    env = step_env(side.pythonpath)
    cmd = [side.python or sys.executable, "-m", "harness.cli", "run", *sel.to_argv(skip=("engine", "timed_steps")),
           "--engine", side.engine,
           "--timed-steps", str(args.steps_per_round), "--baselines-dir", str(workdir / "no-baselines"),
           "--out", str(out_dir)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                          cwd=side.pythonpath[0] if side.pythonpath else None)
    results = out_dir / "results.json"
    if proc.returncode == 2 or not results.exists():
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{side.label}: `harness run` exited {proc.returncode}: {tail}")
    data = json.loads(results.read_text())
    out = {}
    for c in data["cases"]:
        if c["status"] != CaseStatus.OK:
            raise RuntimeError(f"{side.label}: case {c['id']} failed: {c['reason']}")
        d, samples = c["data"], c.get("samples", {})
        counters = {k: v for k, v in samples.items() if k not in NOT_COUNTERS}
        out[c["baseline_key"]] = CaseSamples(d["step_ms"], d["exposed_comm_ms"], counters,
                                             foreign_share=samples.get(FOREIGN))
    return out


def run_rounds(a: Side, b: Side, sel: CaseSelection, args, say: Callable[[str], None],
               plans: dict[str, Plan]) -> tuple[dict, dict, list[str]]:
    """Both sides, args.rounds times, in a random order per round; ({key: CaseSamples} for A and B, order).
    sel: the cases (the flags of `harness compare`); args: rounds, steps_per_round, order_seed; plans: an
    in-process side's plan by engine (plan_sides)."""
    rng = random.Random(args.order_seed)
    pooled: dict[str, dict[str, CaseSamples]] = {a.label: {}, b.label: {}}
    order: list[str] = []
    workdir = Path(tempfile.mkdtemp(prefix="harness-compare-"))
    for n in range(args.rounds):
        sides = [a, b]
        rng.shuffle(sides)
        for side in sides:
            say(f"round {n + 1}/{args.rounds}: {side.label}")
            order.append(side.label)
            got = (_in_process_round(side, plans, say) if side.in_process
                   else _subprocess_round(side, sel, args, workdir, n))
            for key, s in got.items():
                acc = pooled[side.label].setdefault(key, CaseSamples(counters=s.counters))
                acc.rounds_step_ms.append(list(s.step_ms))
                acc.rounds_exposed_ms.append(list(s.exposed_ms))
                if s.foreign_share is not None:
                    acc.rounds_foreign_share.append(s.foreign_share)
    return pooled[a.label], pooled[b.label], order


def most_other_load(side: dict[str, CaseSamples]) -> float | None:
    """The largest share of the CPUs that other processes used while a side's steps were timed, over its cases
    and rounds; None where it was not measured."""
    shares = [x for s in side.values() for x in s.rounds_foreign_share]
    return max(shares) if shares else None


def other_load_line(a: dict[str, CaseSamples], b: dict[str, CaseSamples], judged_busy: bool) -> str:
    """What other processes used of the machine while each side was timed ('' where nothing was measured); where
    it passed FOREIGN_LIMIT and some case is slower or cannot tell, the way out."""
    share_a, share_b = most_other_load(a), most_other_load(b)
    if share_a is None and share_b is None:
        return ""

    def pct(share: float | None) -> str:
        return "-" if share is None else f"{share:.0%}"

    line = f"other processes used up to {pct(share_a)} of the CPUs while A's steps were timed, {pct(share_b)} while B's"
    if max(share_a or 0.0, share_b or 0.0) > FOREIGN_LIMIT and judged_busy:
        line += (f"; beyond {FOREIGN_LIMIT:.0%}, load that fell on one side's rounds more than the other's moves "
                 f"the ratio: stop them or compare on a quiet machine")
    return line


def judge(a: dict[str, CaseSamples], b: dict[str, CaseSamples], min_effect: float):
    """Per case key: (Comparison of step times, Comparison of exposed comm, differing counters), over rounds."""

    out = {}
    for key in sorted(set(a) & set(b)):
        counters = sorted(m for m in set(a[key].counters) | set(b[key].counters)
                          if a[key].counters.get(m) != b[key].counters.get(m))
        diffs = [f"{m}: {a[key].counters.get(m, '-')} -> {b[key].counters.get(m, '-')}" for m in counters]
        out[key] = (compare_rounds(a[key].rounds_step_ms, b[key].rounds_step_ms, min_effect),
                    compare_rounds(a[key].rounds_exposed_ms, b[key].rounds_exposed_ms, min_effect), diffs)
    return out


def pinned_package(args) -> tuple[str, str] | None:
    """(name, version) of the package release B runs with (--package NAME==VERSION, or --megatron-core VERSION
    for short), None when B is not a release; BadInput for a malformed or a doubled one."""
    package, mcore = args.package, args.megatron_core
    if package and mcore:
        raise BadInput("give B once: --package NAME==VERSION or --megatron-core VERSION, not both")
    if mcore:
        return "megatron-core", mcore
    if not package:
        return None
    name, sep, version = package.partition("==")
    if not sep or not name.strip() or not version.strip():
        raise BadInput(f"--package {package!r}: expected NAME==VERSION (e.g. megatron-bridge==0.3.1)")
    return name.strip(), version.strip()


def sides_from_args(args, cache: Path) -> tuple[Side, Side]:
    engines = args.engine or []
    if len(engines) == 2:
        return Side(f"A={engines[0]}", engines[0]), Side(f"B={engines[1]}", engines[1])
    engine = engines[0] if engines else EngineName.MCORE
    if len(engines) > 2:
        raise BadInput(f"--engine given {len(engines)} times; compare takes two engines (A then B) or one")
    here = Side("A=this environment", engine, python=sys.executable)
    pinned = pinned_package(args)
    if pinned:
        from harness.bisect import version_env

        name, version = pinned
        try:
            python = version_env(name, version, cache)
        except RuntimeError as exc:
            raise BadInput(f"B = {name}=={version}: {exc}") from None
        return here, Side(f"B={name} {version}", engine, python=python)
    if args.repo:
        if not args.rev:
            raise BadInput("--repo needs --rev (the commit to compare this checkout against)")
        return here, Side(f"B={args.rev}", engine, pythonpath=["<worktree>"])
    raise BadInput("give two engines (--engine A --engine B), or --package NAME==VERSION (--megatron-core VERSION), "
                   "or --repo PATH --rev REV")


def compare_main(args, sel: CaseSelection, say: Callable[[str], None], plans: dict[str, Plan]) -> int:
    """`harness compare` after its input was checked: sel selects the cases, args the sides and rounds, plans holds
    the in-process sides' plans (plan_sides)."""
    cache = Path(args.cache or Path.home() / ".cache" / "harness-bisect")
    cache.mkdir(parents=True, exist_ok=True)
    a, b = sides_from_args(args, cache)
    worktree = None
    try:
        if "<worktree>" in b.pythonpath:
            from harness.bisect import Worktree

            worktree = Worktree(Path(args.repo).resolve(), cache)
            b.pythonpath = [str(worktree.checkout(args.rev) / args.path_in_repo)]
        backend = resolve_backend(sel.backend, sel.world_size)  # auto: nccl where there are GPUs enough
        effect = sel.suite_params.get("min_effect", MIN_EFFECT_INTERLEAVED[tier_of(backend)])
        samples_a, samples_b, order = run_rounds(a, b, sel, args, say, plans)
    finally:
        if worktree:
            worktree.close()
    verdicts = judge(samples_a, samples_b, effect)
    rows, slower, undecided = [], [], []
    for key, (step, comm, diffs) in verdicts.items():
        verdict = "CANNOT TELL" if step.undecided else step.verdict
        rows.append([key, f"{step.median_a:.1f}", f"{step.median_b:.1f}", f"x{step.ratio:.3f}",
                     f"[{step.ci_low:.3f}, {step.ci_high:.3f}]", f"{min(step.p_slower, step.p_faster):.2g}",
                     f"x{comm.ratio:.2f}", verdict, f"{len(diffs)}"])
        if step.slower:
            slower.append(key)
        elif step.undecided:
            undecided.append(key)
    print(f"compare: {a.label} vs {b.label}, {args.rounds} rounds of {args.steps_per_round} steps per side "
          f"(order {' '.join(x[0] for x in order)}), min effect {effect:.0%}")
    print(table(["case", "A ms", "B ms", "B/A", "95% CI", "p", "exposed B/A", "verdict", "counters differ"], rows))
    print(f"(B/A: per round the ratio of medians, their geometric mean over {args.rounds} rounds; CI and p: a paired "
          f"t-test over the rounds)")
    for key, (_, _, diffs) in verdicts.items():
        for d in diffs:
            print(f"  {key}: {d}")
    load = other_load_line(samples_a, samples_b, bool(slower or undecided))
    if load:
        print(load)
    if args.out:
        atomic_write(Path(args.out) / "compare.json", json.dumps(
            {"a": a.label, "b": b.label, "rounds": args.rounds, "order": order, "min_effect": effect,
             "cases": {k: {"step": vars(s), "exposed": vars(c), "counters_differ": d,
                           "rounds_a": samples_a[k].rounds_step_ms, "rounds_b": samples_b[k].rounds_step_ms,
                           "foreign_share_a": samples_a[k].rounds_foreign_share,
                           "foreign_share_b": samples_b[k].rounds_foreign_share}
                       for k, (s, c, d) in verdicts.items()}}, indent=1))
    different = [key for key, (_, _, diffs) in verdicts.items() if diffs]
    if slower:
        print(f"B is slower than A beyond {effect:.0%} (significant) on {len(slower)} case(s): {', '.join(slower)}")
    if different:
        # exact counters (FLOPs, collective calls and bytes) are not noise: B does other work than A
        print(f"B does different work than A on {len(different)} case(s): its exact counters differ "
              f"({', '.join(different)})")
    if slower or different:
        return 1
    if undecided:
        print(f"cannot tell on {len(undecided)} case(s) ({', '.join(undecided)}): the {CONFIDENCE:.0%} interval "
              f"still reaches beyond x{1 + effect:.2f}; run more --rounds (the rounds are the units)")
        return EXIT_NOTHING_JUDGED
    print("B is not significantly slower than A beyond the minimum effect on any case, and does the same work")
    return 0
