"""`harness bisect` (the first release or commit where a metric crosses a threshold) and `harness
bisect-step` (one candidate: this environment or checkout, for `git bisect run`); harness/bisect/."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from pathlib import Path

from harness.baselines import BASELINES_DIR_FLAG
from harness.commands.case_args import add_case_args
from harness.commands.common import say
from harness.engine_names import EngineName
from harness.errors import BadInput
from harness.files import atomic_write
from harness.outcomes import CHECK_METRIC, PASS_FAIL
from harness.selection import CaseSelection


def add_parser(sub) -> None:
    for name, helptext in (("bisect", "find the first megatron-core version or commit where a metric crosses "
                                      "a threshold"),
                           ("bisect-step", "judge the current checkout / environment for `git bisect run` "
                                           "(exit 0 good, 1 bad, 125 cannot tell)")):
        p = sub.add_parser(name, help=helptext)
        add_case_args(p)
        p.add_argument("--metric", required=True,
                       help="check:<suite>.<check> (bad where that check does not pass: fails or cannot tell), "
                            "a baselined metric of the suite (e.g. rank0.save_heap_peak_mib; the worst case of the "
                            "selection counts), or 'fail': bad when any case does not pass")
        p.add_argument("--max", default=PASS_FAIL, help="bad above this: a number, baseline+P%% or baseline+X")
        p.add_argument("--error-is-bad", action="store_true", help="a case that errors is bad (default: cannot tell)")
        p.add_argument("--baselines-dir", **BASELINES_DIR_FLAG)
        p.add_argument("--fresh-ranks", action="store_true")
        p.add_argument("--find-fix", action="store_true",
                       help="the candidates go from bad to good: find the first good one (when a fix landed)"
                       + ("" if name == "bisect" else "; bisect-step then exits 0 while still bad, 1 once fixed "
                                                      "(git bisect start --term-old broken --term-new fixed)"))
        if name == "bisect":
            p.add_argument("--package", nargs="+", metavar="NAME VERSION",
                           help="a distribution, then its releases oldest first (good .. bad) or a range A..B from "
                                "the package index: megatron-core, megatron-bridge, mbridge, transformer-engine, "
                                "your framework; each installed --no-deps into a cached environment over this one")
            p.add_argument("--megatron-core", nargs="+", metavar="VERSION",
                           help="short for --package megatron-core ...")
            p.add_argument("--pre", action="store_true", help="a range A..B includes pre-releases")
            p.add_argument("--repo", help="a local git checkout of the engine (Megatron-LM, your framework)")
            p.add_argument("--good",
                           help="--repo: a commit without the regression (with --find-fix: the later, fixed one)")
            p.add_argument("--bad", help="--repo: a later commit with it (with --find-fix: the earlier, broken one)")
            p.add_argument("--path-in-repo", default=".", help="--repo: the directory put on the path (default: root)")
            p.add_argument("--git-bisect-run", action="store_true",
                           help="--repo: after the gate, hand the search to `git bisect run` "
                                "with `harness bisect-step`")
            p.add_argument("--cache", default=None, help="virtualenvs and worktrees (default ~/.cache/harness-bisect)")
            p.set_defaults(func=main)
        else:
            p.add_argument("--json", default=None, help="also write the verdict as JSON here")
            p.add_argument("--json-dir", default=None, help="also write the verdict as JSON into this directory "
                                                            "(one file per step, with the commit judged)")
            p.set_defaults(func=step)


def _spec(args, sel: CaseSelection):
    from harness.bisect import StepSpec

    return StepSpec(sel.to_argv(), args.metric, args.max, args.error_is_bad,
                    os.path.abspath(args.baselines_dir) if args.baselines_dir else None,  # steps run elsewhere
                    args.fresh_ranks)


def main(args) -> int:
    """`harness bisect`: releases (--package NAME VERSIONS, --megatron-core VERSIONS) or commits (--repo,
    --good, --bad); --find-fix searches for the first good candidate after bad ones instead."""
    from harness.bisect import Threshold
    from harness.driver import plan

    Threshold(args.max)
    if args.package and args.megatron_core:
        raise BadInput("give --package NAME VERSIONS or --megatron-core VERSIONS, not both")
    if args.package and len(args.package) < 2:
        raise BadInput("--package takes the distribution then its versions, "
                       "e.g. --package megatron-core 0.16.0..0.16.1")
    package, versions = (args.package[0], args.package[1:]) if args.package else \
        ("megatron-core", args.megatron_core) if args.megatron_core else (None, None)
    if versions:
        from harness.bisect.candidates import check_ranges

        check_ranges(versions)
    if args.repo and not Path(args.repo, ".git").exists():
        raise BadInput(f"--repo {args.repo}: not a git checkout (no .git there)")
    if not package and not (args.repo and args.good and args.bad):
        raise BadInput("give --package NAME VERSIONS (or --megatron-core VERSIONS), or --repo PATH with "
                       "--good REV and --bad REV")
    if args.git_bisect_run and not args.repo:
        raise BadInput("--git-bisect-run bisects the commits of --repo (git bisect knows no releases)")
    sel = CaseSelection.from_args(args)
    # the selection is planned here too, so bad input is refused before any environment is built; the
    # engine is imported in each candidate's environment (a --repo engine lives in the checkout), not here
    planned = plan(dataclasses.replace(sel, engine=EngineName.MCORE), baselines_dir=args.baselines_dir)
    from harness.bisect.step import refuse_unknown_metric

    refuse_unknown_metric(planned, args.metric)
    return bisect(args, _spec(args, sel), package, versions)


def bisect(args, spec, package: str | None, versions: list[str] | None) -> int:
    import shutil
    import tempfile

    from harness.bisect import (
        FIX,
        GOOD,
        REGRESSION,
        SKIP,
        CommitCandidates,
        GateRefused,
        PackageCandidates,
        StepResult,
        flipped,
        format_table,
        run_in,
        search,
    )

    cache = Path(args.cache or Path.home() / ".cache" / "harness-bisect")
    cache.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="harness-bisect-"))
    candidates: PackageCandidates | CommitCandidates | None = None
    try:
        if package:
            candidates = PackageCandidates(package, versions or [], cache, prereleases=args.pre)
        else:
            repo = Path(args.repo).resolve()
            old, new = (args.bad, args.good) if args.find_fix else (args.good, args.bad)
            candidates = CommitCandidates(repo, old, new, cache, args.path_in_repo)
        labels = candidates.labels
        chosen = candidates

        def judge(i: int) -> StepResult:
            try:
                env = chosen.environment(i)
            except RuntimeError as exc:  # a release that does not install: cannot tell
                return StepResult(SKIP, why=str(exc))
            return run_in(env.python, spec, env.pythonpath, workdir)

        terms = FIX if args.find_fix else REGRESSION
        judged: Callable[[int], StepResult] = judge
        if args.find_fix:  # search for the first good one: swap the states (a skip stays a skip)
            judged = flipped(judge)
        if args.metric.startswith(CHECK_METRIC):
            what = f"bad where {args.metric.removeprefix(CHECK_METRIC)} does not pass"
        else:
            what = "bad" if args.metric == PASS_FAIL else f"{args.metric} > {args.max} is bad"
        say(f"bisect over {len(labels)} candidates ({what}), for the first {terms.new}: {labels[0]} .. {labels[-1]}")
        try:
            if args.git_bisect_run:
                first, tried = _git_bisect_run(candidates, spec, judged, terms, workdir, args.find_fix)
            else:
                first, tried = search(labels, judged, say, terms)
        except GateRefused as exc:
            print(format_table(exc.tried, args.metric, None, terms, package))
            raise
        print(format_table(tried, args.metric, first, terms, package))
        found = next((t.result for t in tried if t.index == first), None)
        before = [t for t in tried if t.index < first and t.result.verdict == GOOD]
        last_old = max(before, key=lambda t: t.index).index
        untested = labels[last_old + 1:first]
        print(f"first {terms.new}: {labels[first]}" + (f" ({found.why})" if found else "")
              + f"; last {terms.old}: {labels[last_old]}"
              + (f"; not judged in between: {', '.join(untested)}" if untested else ""))
        adjusted = list(dict.fromkeys(a for t in tried for a in t.result.adjustments))
        if adjusted:
            print("judged a patched setup - the harness adjusted the engine under test:\n"
                  + "\n".join(f"  - {a}" for a in adjusted))
        return 0
    finally:
        if candidates is not None:
            candidates.close()
        shutil.rmtree(workdir, ignore_errors=True)


def _git_bisect_run(candidates, spec, judge, terms, workdir: Path, find_fix: bool):
    """The gate with our own steps, then `git bisect run <python> -m harness.cli bisect-step ...` in the
    worktree; (index of the first new commit, what was tried), the steps read from their JSON files."""
    import subprocess

    from harness.bisect import Tried, gate, read_step_json, step_env
    from harness.bisect.candidates import git

    tried = gate(candidates.labels, judge, say, terms)
    wt = candidates.worktree.path
    old, new = ("broken", "fixed") if find_fix else ("good", "bad")
    steps = workdir / "git-bisect-steps"
    steps.mkdir()
    git(wt, "bisect", "start", f"--term-old={old}", f"--term-new={new}", candidates.commits[-1][0],
        candidates.commits[0][0])
    try:
        extra = ["--json-dir", str(steps)] + (["--find-fix"] if find_fix else [])
        path = wt / candidates.path_in_repo
        say(f"git bisect run in {wt}")
        proc = subprocess.run(["git", "bisect", "run", sys.executable, *spec.command(extra)],
                              cwd=wt, env=step_env([str(path)]), capture_output=True, text=True)  # git: the top level
        refused = steps / "refused.txt"
        if refused.exists():  # bad input is the same for every candidate: the step aborted git bisect run
            raise BadInput(f"bisect-step refused its input: {refused.read_text().strip()}")
        if proc.returncode != 0:
            tail = ((proc.stderr or proc.stdout).strip().splitlines() or ["no output"])[-1]
            raise BadInput(f"git bisect run failed (exit {proc.returncode}): {tail}")
        first_sha = git(wt, "rev-parse", f"refs/bisect/{new}")
    finally:
        subprocess.run(["git", "-C", str(wt), "bisect", "reset"], capture_output=True)
    for f in sorted(steps.glob("*.json")):
        r, extra_fields = read_step_json(f)
        i = candidates.index_of(extra_fields.get("commit") or "")
        if i is not None:  # git's exit codes are the search's verdicts (old 0, new 1, 125 skip)
            tried.append(Tried(i, candidates.labels[i], r, "git bisect", extra_fields.get("wall_s", 0.0)))
    first = candidates.index_of(first_sha)
    if first is None:
        raise BadInput(f"git bisect named {first_sha[:10]}, not a commit between the ends")
    return first, tried


GIT_BISECT_ABORT = 255  # an exit code that stops `git bisect run`


def step(args) -> int:
    """`harness bisect-step`: exit 0 good, 1 bad, 125 cannot tell (git bisect run's convention); with
    --find-fix 0 while still bad, 1 once fixed."""
    import subprocess
    import time

    from harness.bisect import VERDICTS, Threshold, flip, run_step, write_step_json

    t0 = time.monotonic()
    try:
        Threshold(args.max)
        sel = CaseSelection.from_args(args)
        r = run_step(sel, _spec(args, sel))
    except BadInput as exc:
        if args.json_dir:  # under git bisect run, where exit 2 would mean "bad": say why, and abort it
            atomic_write(Path(args.json_dir, "refused.txt"), str(exc))
            print(f"harness: error: {exc}", file=sys.stderr)
            return GIT_BISECT_ABORT
        raise
    print(f"bisect-step: {VERDICTS[r.verdict]}: {r.why} ({r.case})")
    if args.find_fix:
        r.verdict = flip(r.verdict)
    if args.json:
        write_step_json(args.json, r)
    if args.json_dir:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
        write_step_json(Path(args.json_dir) / f"step-{time.time_ns()}.json", r, wall_s=time.monotonic() - t0,
                        commit=head.stdout.strip() if head.returncode == 0 else None)
    return r.verdict
