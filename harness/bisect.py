"""Local bisect of a regression: a case, a metric and a threshold, over megatron-core releases (each in a
cached virtualenv) or over the commits of a local git checkout (a worktree put on the path).

Every candidate is judged by `harness bisect-step` in a fresh process (so nothing imported for one
candidate leaks into the next); the same command works as `git bisect run harness bisect-step ...`
(exit 0 good, 1 bad, 125 cannot tell). The reproduction gate runs first: the bad end must be bad and
the good end good, or nothing is searched.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from harness.errors import BadInput

GOOD, BAD, SKIP = 0, 1, 125  # git bisect run's exit codes
VERDICTS = {GOOD: "good", BAD: "BAD", SKIP: "skip"}
_THRESHOLD_RE = re.compile(r"^baseline\s*\+\s*([0-9.]+)\s*(%?)$")


# -- one step: judge the current environment ---------------------------------------------------------
@dataclass
class Threshold:
    """`--max`: an absolute value, or `baseline+P%` / `baseline+X` from the stored baseline of each case."""

    text: str

    def __post_init__(self) -> None:
        if self.text != "fail" and not _THRESHOLD_RE.match(self.text.replace(" ", "")):
            try:
                float(self.text)
            except ValueError:
                raise BadInput(f"--max {self.text!r}: give a number, baseline+P% or baseline+X "
                               f"(e.g. --max 40 or --max baseline+10%)") from None

    def resolve(self, baseline: float | None) -> float:
        m = _THRESHOLD_RE.match(self.text.replace(" ", ""))
        if not m:
            return float(self.text)
        if baseline is None:
            raise BadInput(f"--max {self.text}: no stored baseline for this case and metric; give an absolute --max")
        add = float(m.group(1))
        return baseline * (1 + add / 100) if m.group(2) else baseline + add


@dataclass
class StepResult:
    verdict: int  # GOOD | BAD | SKIP
    value: float | None = None  # the metric of the worst case (closest to / furthest over its threshold)
    threshold: float | None = None
    case: str = ""
    why: str = ""
    versions: dict[str, str] = field(default_factory=dict)
    adjustments: list[str] = field(default_factory=list)  # what the harness changed in the engine it judged


def judge_run(run, metric: str, threshold: Threshold, error_is_bad: bool = False) -> StepResult:
    """Bad when any case's metric exceeds its threshold (metric 'fail': when any case does not pass); the
    step names what the harness adjusted in the engine it judged."""
    from harness.report import run_adjustments

    step = _judge_outcomes(run, metric, threshold, error_is_bad)
    step.adjustments = list(run_adjustments(run))
    return step


def _judge_outcomes(run, metric: str, threshold: Threshold, error_is_bad: bool) -> StepResult:
    from harness import baselines
    from harness.report import versions

    vers = {k: v for k, v in versions().items() if k not in ("harness", "harness_commit")}
    outcomes = run.outcomes()
    broken = [o for o in outcomes if o.outcome in ("error", "skipped")]
    if broken:
        o = broken[0]
        verdict = BAD if (error_is_bad and o.outcome == "error") else SKIP
        return StepResult(verdict, case=o.result.case.id, why=f"{o.outcome}: {o.reason}", versions=vers)
    if metric == "fail":
        failed = [o for o in outcomes if o.outcome != "pass"]
        o = (failed or outcomes)[0]
        return StepResult(BAD if failed else GOOD, case=o.result.case.id, why=o.reason or "every check passed",
                          versions=vers)
    suite = run.suite
    if not hasattr(suite, "samples"):
        raise BadInput(f"suite {suite.name!r} has no numeric metrics; use --metric fail")
    data: dict[str, dict] = {}
    worst: StepResult | None = None
    for o in outcomes:
        samples = suite.samples(o.result)
        if metric not in samples:
            continue
        path = baselines.baseline_path(getattr(suite, "baselines_dir", None), _platform(o.result), suite.name)
        if str(path) not in data:
            data[str(path)] = baselines.load(path)
        case_entry = data[str(path)].get("entries", {}).get(suite.key(o.result.case), {})
        entry = case_entry.get(metric)
        if entry and "samples" in entry and hasattr(suite, "timed_comparison"):
            step = _judge_timed(suite, o.result, metric, case_entry, threshold, vers)
        else:
            limit = threshold.resolve(entry["value"] if entry else None)
            value = samples[metric]
            step = StepResult(BAD if value > limit else GOOD, value, limit, o.result.case.id,
                              f"{metric} {value:.2f} {'>' if value > limit else '<='} {limit:.2f}", vers)
        value, limit = step.value, step.threshold
        if worst is None or value - limit > worst.value - worst.threshold:
            worst = step
    if worst is None:
        known = sorted({m for o in outcomes for m in suite.samples(o.result)})
        raise BadInput(f"no case of the selection has metric {metric!r}; metrics: {', '.join(known) or 'none'}")
    return worst


def _judge_timed(suite, result, metric: str, case_entry: dict, threshold: Threshold, vers: dict) -> StepResult:
    """A timed figure (step-perf) is judged as the suite judges it: bad when significantly slower than the
    baseline's samples beyond the minimum effect (`--max baseline+P%` sets the effect, else the suite's)."""
    m = _THRESHOLD_RE.match(threshold.text.replace(" ", ""))
    effect = float(m.group(1)) / 100 if m and m.group(2) else None
    cmp = suite.timed_comparison(result, metric, case_entry, effect)
    return StepResult(BAD if cmp.slower else GOOD, cmp.median_b, cmp.median_a * (1 + cmp.min_effect), result.case.id,
                      f"{metric} {cmp.describe()}: {'significantly slower' if cmp.slower else 'not significantly slower'}",
                      vers)


def _platform(result) -> str:
    from harness.platform import detect_platform

    return detect_platform(result.case.backend).key


def run_step(args) -> StepResult:
    """Run the selected cases in this environment and judge them (the body of `harness bisect-step`)."""
    from harness.cli import _case_kwargs
    from harness.driver import plan, run_suite

    threshold = Threshold(args.max)
    kwargs = _case_kwargs(args)
    plan(args.suite, args.model, args.world_size, args.layout, **kwargs)
    run = run_suite(args.suite, args.model, args.world_size, args.layout, baselines_dir=args.baselines_dir,
                    fresh_ranks=args.fresh_ranks, **kwargs).stop_if_interrupted()
    return judge_run(run, args.metric, threshold, args.error_is_bad)


# -- candidates: megatron-core releases or commits ----------------------------------------------------
def index_versions(package: str, python: str = sys.executable) -> list[str]:
    """Released versions of a package on the configured index, oldest first."""
    from packaging.version import Version

    proc = subprocess.run([python, "-m", "pip", "index", "versions", package], capture_output=True, text=True,
                          timeout=120)
    m = re.search(r"Available versions:\s*(.+)", proc.stdout)
    if proc.returncode != 0 or not m:
        raise BadInput(f"cannot list {package} versions from the package index: "
                       f"{(proc.stderr.strip().splitlines() or ['no output'])[-1]}")
    return sorted((v.strip() for v in m.group(1).split(",")), key=Version)


def expand_versions(specs: list[str], available: Callable[[], list[str]]) -> list[str]:
    """'0.15.0 0.16.1' as given, or 'A..B' for every release from A to B on the index; oldest first."""
    from packaging.version import InvalidVersion, Version

    out: list[str] = []
    for spec in specs:
        if ".." in spec:
            lo, hi = (Version(x) for x in spec.split("..", 1))
            inside = [v for v in available() if lo <= Version(v) <= hi and not Version(v).is_prerelease]
            if not inside:
                raise BadInput(f"no released version in {spec} on the package index")
            out += inside
        else:
            try:
                Version(spec)
            except InvalidVersion:
                raise BadInput(f"{spec!r} is not a version (give e.g. 0.16.1, or a range 0.15.0..0.16.1)") from None
            out.append(spec)
    if len(out) < 2:
        raise BadInput("bisect needs at least a good and a bad version (oldest first, e.g. 0.15.0..0.16.1)")
    return list(dict.fromkeys(out))


def version_env(package: str, version: str, cache: Path) -> str:
    """The python of a cached virtualenv holding `package==version` over this environment.

    The venv gets only that package (--no-deps); a .pth file adds this interpreter's site-packages after
    its own, so torch, the harness and the rest come from here and the pinned package shadows ours."""
    import site
    import sysconfig

    venv = cache / f"{package}-{version}"
    python = venv / "bin" / "python"
    marker = venv / ".harness-ready"
    if not marker.exists():
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, capture_output=True)
        purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 check=True, capture_output=True, text=True).stdout.strip()
        parents = [p for p in [sysconfig.get_paths()["purelib"], *site.getsitepackages()] if os.path.isdir(p)]
        Path(purelib, "zz_harness_parent.pth").write_text(
            "import site; " + "; ".join(f"site.addsitedir({p!r})" for p in dict.fromkeys(parents)) + "\n")
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", purelib,
                               f"{package}=={version}"], capture_output=True, text=True)
        if proc.returncode != 0:
            shutil.rmtree(venv, ignore_errors=True)
            raise RuntimeError(f"pip install {package}=={version} failed: "
                               f"{(proc.stderr.strip().splitlines() or ['?'])[-1]}")
        marker.write_text(version)
    return str(python)


class Worktree:
    """A detached worktree of a local checkout, moved from commit to commit; removed on close."""

    def __init__(self, repo: Path, cache: Path):
        self.repo = repo
        self.path = Path(tempfile.mkdtemp(prefix="harness-bisect-wt-", dir=cache))
        self.path.rmdir()
        _git(repo, "worktree", "add", "--detach", "--quiet", str(self.path), "HEAD")

    def checkout(self, commit: str) -> Path:
        _git(self.path, "checkout", "--detach", "--quiet", "--force", commit)
        return self.path

    def close(self) -> None:
        subprocess.run(["git", "-C", str(self.repo), "worktree", "remove", "--force", str(self.path)],
                       capture_output=True)
        shutil.rmtree(self.path, ignore_errors=True)


def _git(repo: Path, *args: str) -> str:
    proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise BadInput(f"git {' '.join(args[:3])} in {repo} failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    return proc.stdout.strip()


def commits_between(repo: Path, old: str, new: str) -> list[tuple[str, str]]:
    """[(sha, subject)] from old to new inclusive, oldest first (new must descend from old)."""
    old_sha, new_sha = _git(repo, "rev-parse", "--verify", f"{old}^{{commit}}"), \
        _git(repo, "rev-parse", "--verify", f"{new}^{{commit}}")
    if subprocess.run(["git", "-C", str(repo), "merge-base", "--is-ancestor", old_sha, new_sha]).returncode != 0:
        raise BadInput(f"{old} is not an ancestor of {new} in {repo}: the earlier commit comes first "
                       f"(--good for a regression, --bad with --find-fix)")
    lines = _git(repo, "log", "--reverse", "--ancestry-path", "--format=%H %s", f"{old_sha}..{new_sha}").splitlines()
    subject = _git(repo, "log", "-1", "--format=%s", old_sha)
    return [(old_sha, subject)] + [tuple(line.split(" ", 1)) if " " in line else (line, "") for line in lines]


# -- the search ---------------------------------------------------------------------------------------
@dataclass
class Tried:
    index: int
    label: str
    result: StepResult
    role: str  # "gate" or "step N"
    wall_s: float


@dataclass(frozen=True)
class Terms:
    """Names of the two states, as git bisect's old / new: a regression search goes good -> bad,
    a fix search (--find-fix) bad -> good. `new` is what is searched for."""

    old: str = "good"
    new: str = "bad"

    def name(self, verdict: int) -> str:
        return {GOOD: self.old, BAD: self.new.upper(), SKIP: "skip"}[verdict]


REGRESSION, FIX = Terms("good", "bad"), Terms("bad", "fixed")


def search(labels: list[str], judge: Callable[[int], StepResult], say: Callable[[str], None],
           terms: Terms = REGRESSION) -> tuple[int, list[Tried]]:
    """Gate (the last must be new, the first old), then binary search; (index of the first new, tried).

    judge returns BAD for the new state, GOOD for the old one. Raises GateRefused when the gate fails.
    Candidates that cannot be judged (SKIP) are stepped around; if every candidate between the last old
    and the first new one is skipped, the first new one is returned and the table shows the skipped ones."""
    tried: list[Tried] = []

    def probe(i: int, role: str) -> StepResult:
        say(f"[{role}] {labels[i]} ...")
        t0 = time.monotonic()
        r = judge(i)
        tried.append(Tried(i, labels[i], r, role, time.monotonic() - t0))
        say(f"[{role}] {labels[i]}: {terms.name(r.verdict)} ({r.why}) in {time.monotonic() - t0:.0f}s")
        return r

    last = len(labels) - 1
    r = probe(last, f"gate: {terms.new}")
    if r.verdict != BAD:
        raise GateRefused(f"the {terms.new} end {labels[last]} does not reproduce: {terms.name(r.verdict)} ({r.why})",
                          tried)
    r = probe(0, f"gate: {terms.old}")
    if r.verdict != GOOD:
        raise GateRefused(f"the {terms.old} end {labels[0]} is not {terms.old}: {terms.name(r.verdict)} ({r.why})", tried)
    lo, hi, skipped, n = 0, last, set(), 0
    while True:
        open_ = [i for i in range(lo + 1, hi) if i not in skipped]
        if not open_:
            return hi, tried
        mid = (lo + hi) // 2
        mid = min(open_, key=lambda i: (abs(i - mid), i))
        n += 1
        r = probe(mid, f"step {n}")
        if r.verdict == SKIP:
            skipped.add(mid)
        elif r.verdict == BAD:
            hi = mid
        else:
            lo = mid


class GateRefused(BadInput):
    def __init__(self, message: str, tried: list[Tried]):
        super().__init__(message)
        self.tried = tried


def format_table(tried: list[Tried], metric: str, first_bad: int | None, terms: Terms = REGRESSION,
                 package: str | None = None) -> str:
    """package: the distribution bisected over (its version column; the candidate label where the step did
    not report it), else megatron-core's."""
    from harness.report import fmt_table

    numeric = metric != "fail"
    rows = []
    for t in sorted(tried, key=lambda t: t.index):
        r = t.result
        figures = ["-" if r.value is None else f"{r.value:.2f}", "-" if r.threshold is None else f"{r.threshold:.2f}"]
        version = r.versions.get(package or "megatron-core") or (t.label if package else "?")
        rows.append([t.label, t.role, version, *(figures if numeric else []),
                     terms.name(r.verdict) + (f" <- first {terms.new}" if t.index == first_bad else ""),
                     f"{t.wall_s:.0f}s", r.why if r.verdict == SKIP or r.value is None else ""])
    header = ["candidate", "tried as", package or "megatron-core", *([metric, "threshold"] if numeric else []), "verdict", "wall", "note"]
    return fmt_table(header, rows)


def step_command(args, extra: list[str] | None = None) -> list[str]:
    """The `harness bisect-step` arguments that judge the same cases with the same metric."""
    from harness.cli import case_argv

    cmd = ["-m", "harness.cli", "bisect-step", *case_argv(args), "--metric", args.metric, "--max", args.max]
    if args.baselines_dir is not None:
        cmd += ["--baselines-dir", args.baselines_dir]
    cmd += [f"--{flag.replace('_', '-')}" for flag in ("error_is_bad", "fresh_ranks") if getattr(args, flag)]
    return cmd + (extra or [])


def run_in(python: str, args, pythonpath: list[str], workdir: Path) -> StepResult:
    """One candidate: `harness bisect-step` in a fresh process of that environment."""
    out = workdir / f"step-{time.monotonic_ns()}.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*pythonpath, str(Path(__file__).resolve().parents[1]),
                                         *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    proc = subprocess.run([python, *step_command(args, ["--json", str(out)])], env=env, capture_output=True, text=True,
                          cwd=pythonpath[0] if pythonpath else None)
    if out.exists():
        d = json.loads(out.read_text())
        return StepResult(d["verdict"], d.get("value"), d.get("threshold"), d.get("case", ""), d.get("why", ""),
                          d.get("versions", {}), d.get("adjustments", []))
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    if proc.returncode == 2:  # bad input is the same for every candidate: stop
        raise BadInput(f"bisect-step refused its input: {tail}")
    return StepResult(SKIP, why=f"bisect-step exited {proc.returncode}: {tail}")


def bisect(args, say: Callable[[str], None]) -> int:
    """`harness bisect`: versions (--megatron-core ...) or commits (--repo, --good, --bad); --find-fix
    searches for the first good candidate after bad ones instead."""
    Threshold(args.max)  # bad input before anything runs
    if args.baselines_dir:
        args.baselines_dir = os.path.abspath(args.baselines_dir)  # steps run in other directories
    cache = Path(args.cache or Path.home() / ".cache" / "harness-bisect")
    cache.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="harness-bisect-"))
    worktree = None
    try:
        package = args.package_name  # set by the CLI from --package NAME ... or --megatron-core ...
        if package:
            versions = expand_versions(args.versions, lambda: index_versions(package))
            labels = versions

            def judge(i: int) -> StepResult:
                try:
                    python = version_env(package, versions[i], cache)
                except RuntimeError as exc:
                    return StepResult(SKIP, why=str(exc))
                return run_in(python, args, [], workdir)
        else:
            if not (args.repo and args.good and args.bad):
                raise BadInput("give --package NAME VERSIONS (or --megatron-core VERSIONS), or --repo PATH with "
                               "--good REV and --bad REV")
            repo = Path(args.repo).resolve()
            commits = commits_between(repo, *((args.bad, args.good) if args.find_fix else (args.good, args.bad)))
            labels = [f"{sha[:10]} {subject[:50]}" for sha, subject in commits]
            worktree = Worktree(repo, cache)

            def judge(i: int) -> StepResult:
                path = worktree.checkout(commits[i][0])
                return run_in(sys.executable, args, [str(path / args.path_in_repo)], workdir)
        terms = FIX if args.find_fix else REGRESSION
        if args.find_fix:  # search for the first good one: swap the states (a skip stays a skip)
            judge = _flipped(judge)
        what = "bad" if args.metric == "fail" else f"{args.metric} > {args.max} is bad"
        say(f"bisect over {len(labels)} candidates ({what}), for the first {terms.new}: {labels[0]} .. {labels[-1]}")
        try:
            first, tried = search(labels, judge, say, terms)
        except GateRefused as exc:
            print(format_table(exc.tried, args.metric, None, terms, package))
            raise
        print(format_table(tried, args.metric, first, terms, package))
        found = next(t.result for t in tried if t.index == first)
        before = [t for t in tried if t.index < first and t.result.verdict == GOOD]
        last_old = max(before, key=lambda t: t.index).index
        untested = labels[last_old + 1:first]
        print(f"first {terms.new}: {labels[first]} ({found.why}); last {terms.old}: {labels[last_old]}"
              + (f"; not judged in between: {', '.join(untested)}" if untested else ""))
        adjusted = list(dict.fromkeys(a for t in tried for a in t.result.adjustments))
        if adjusted:
            print("judged a patched setup - the harness adjusted the engine under test:\n"
                  + "\n".join(f"  - {a}" for a in adjusted))
        return 0
    finally:
        if worktree:
            worktree.close()
        shutil.rmtree(workdir, ignore_errors=True)


def _flipped(judge: Callable[[int], StepResult]) -> Callable[[int], StepResult]:
    def flipped(i: int) -> StepResult:
        r = judge(i)
        r.verdict = {GOOD: BAD, BAD: GOOD}.get(r.verdict, r.verdict)
        return r
    return flipped


def write_step_json(path: str, r: StepResult) -> None:
    Path(path).write_text(json.dumps({"verdict": r.verdict, "value": r.value, "threshold": r.threshold,
                                      "case": r.case, "why": r.why, "versions": r.versions,
                                      "adjustments": r.adjustments}))


def step_main(args) -> int:
    """`harness bisect-step`: exit 0 good, 1 bad, 125 cannot tell (git bisect run's convention)."""
    r = run_step(args)
    print(f"bisect-step: {VERDICTS[r.verdict]}: {r.why} ({r.case})")
    if args.json:
        write_step_json(args.json, r)
    return r.verdict

