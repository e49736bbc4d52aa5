"""The `harness` command. Exit codes: 0 all checks pass, 1 a check failed, 2 bad input, 5 nothing judged,
143 / 130 interrupted by SIGTERM / Ctrl-C (finished cases kept)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from harness.errors import BadInput, Interrupted
from harness.spec import CaseOptions


def _layouts(args) -> int:
    from harness.layouts import enumerate_layouts, validate
    from harness.models import load_model
    from harness.spec import Layout

    model = load_model(args.model)
    if args.world_size < 1:
        raise BadInput(f"--world-size must be >= 1, got {args.world_size}")
    if args.layout:
        valid = [validate(Layout.parse(lid), model, args.world_size) for lid in args.layout]
        for lay in valid:
            print(f"{lay.id}\ttp={lay.tp} pp={lay.pp} cp={lay.cp} dp={lay.dp}  valid")
        return 0
    layouts = enumerate_layouts(model, args.world_size)
    if not layouts:
        from harness.layouts import violations

        why = "; ".join(violations(Layout(dp=args.world_size), model, args.world_size))
        raise BadInput(f"no layout of world size {args.world_size} is valid for model {model.name} "
                       f"(pure DP tp1-pp1-cp1-dp{args.world_size}: {why}); pick a world size that divides its shape")
    for lay in layouts:
        print(f"{lay.id}\ttp={lay.tp} pp={lay.pp} cp={lay.cp} dp={lay.dp}")
    return 0


def _options(args) -> CaseOptions:
    if args.steps < 1:
        raise BadInput(f"--steps must be >= 1, got {args.steps}")
    if args.seed < 0:
        raise BadInput(f"--seed must be >= 0, got {args.seed}")
    if args.timeout is not None and not args.timeout > 0:
        raise BadInput(f"--timeout must be > 0 seconds, got {args.timeout}")
    return CaseOptions(
        steps=args.steps, seed=args.seed, dtype=args.dtype,
        use_distributed_optimizer=args.distributed_optimizer, overlap_grad_reduce=args.overlap_grad_reduce,
        fully_parallel_save=args.fully_parallel_save, async_save=args.async_save,
    )


def _suite_params(args) -> dict:
    """Suite attributes set by flags (refused by driver.plan for a suite that has no such attribute)."""
    params = {}
    if args.timed_steps is not None:
        if args.timed_steps < 3:
            raise BadInput(f"--timed-steps must be >= 3 (the statistics need samples), got {args.timed_steps}")
        params["timed_steps"] = args.timed_steps
    if args.min_effect is not None:
        if not 0 < args.min_effect < 10:
            raise BadInput(f"--min-effect is a fraction of the baseline median (e.g. 0.1 for 10%), got {args.min_effect}")
        params["min_effect"] = args.min_effect
    return params


def _case_kwargs(args) -> dict:
    """Keyword arguments of driver.plan / run_suite from the shared case-selection flags."""
    return dict(engine=args.engine, backend=args.backend, options=_options(args), timeout_s=args.timeout,
                ckpt_formats=args.ckpt_format, suite_params=_suite_params(args))


def _out_dir(path: str | None, flag: str = "--out") -> Path | None:
    """The output directory, created and shown writable before anything runs (BadInput otherwise)."""
    from harness.report.files import prepare_out_dir

    return prepare_out_dir(Path(path), flag) if path else None


def _run(args) -> int:
    from harness import report
    from harness.driver import plan, run_suite

    kwargs = _case_kwargs(args)
    if args.shuffle is not None and args.shuffle < 0:
        raise BadInput(f"--shuffle takes a seed >= 0, got {args.shuffle}")
    plan(args.suite, args.model, args.world_size, args.layout, baselines_dir=args.baselines_dir,
         **kwargs)  # all bad input -> exit 2 before any rank starts
    out = _out_dir(args.out)
    run = run_suite(args.suite, args.model, args.world_size, args.layout, fresh_ranks=args.fresh_ranks,
                    shuffle_seed=args.shuffle, baselines_dir=args.baselines_dir, out_dir=out, label=args.label, **kwargs)
    print(report.format_run(run))
    if out:
        print(f"results: {out / 'results.json'}")
    return run.exit_code


def _baselines_diff(args) -> int:
    from harness import baselines
    from harness.platform import detect_platform, resolve_backend
    from harness.suites import get_suite

    suite = get_suite(args.suite)
    platform = args.platform or detect_platform(resolve_backend(args.backend, args.world_size)).key
    path = baselines.baseline_path(args.baselines_dir, platform, suite.name)
    if not path.exists():
        raise BadInput(f"no baseline file {path}; record one with `harness baselines record --suite {suite.name}`")
    new = baselines.load(path)
    if args.old:
        if not Path(args.old).exists():
            raise BadInput(f"--old {args.old}: no such file")
        old, what = baselines.load(Path(args.old)), args.old
    else:
        old, what = baselines.load_at_revision(path, args.against), f"{path.name} at {args.against}"
    print(f"{what} -> {path}:")
    print(baselines.diff_entries(old.get("entries", {}), new["entries"], removed=True))
    return 0


def _baselines(args) -> int:
    from harness import baselines, report
    from harness.driver import plan, run_suite

    if args.action == "diff":
        return _baselines_diff(args)
    kwargs = _case_kwargs(args)
    if args.repeats < 3:
        raise BadInput(f"--repeats must be >= 3 so the spread can set the tolerance, got {args.repeats}")
    suite, cases = plan(args.suite, args.model, args.world_size, args.layout, baselines_dir=args.baselines_dir,
                        **kwargs)
    if not hasattr(suite, "samples"):
        raise BadInput(f"suite {args.suite!r} has no baselines")
    if args.action == "check":
        run = run_suite(args.suite, args.model, args.world_size, args.layout, baselines_dir=args.baselines_dir,
                        **kwargs)
        print(report.format_run(run))
        return run.exit_code
    try:
        path, diff = baselines.record_suite(args.suite, args.model, args.world_size, args.layout,
                                            repeats=args.repeats, baselines_dir=args.baselines_dir, **kwargs)
    except RuntimeError as exc:
        print(f"harness: error: {exc}", file=sys.stderr)
        return 1
    print(f"recorded {path}:\n{diff}")
    return 0


def _report(args) -> int:
    from harness.report.files import load_runs, prepare_out_dir, write_report

    load_runs(Path(args.dir))  # a directory with readable results, before anything is written
    prepare_out_dir(Path(args.dir), "DIR")
    written = write_report(Path(args.dir))
    for kind, path in written.items():
        print(f"{kind}: {path}")
    return 0


def _bisect(args) -> int:
    from harness.bisect import Threshold, bisect
    from harness.driver import plan

    Threshold(args.max)
    if args.package and args.megatron_core:
        raise BadInput("give --package NAME VERSIONS or --megatron-core VERSIONS, not both")
    if args.package and len(args.package) < 2:
        raise BadInput("--package takes the distribution then its versions, e.g. --package megatron-core 0.16.0..0.16.1")
    args.package_name, args.versions = (args.package[0], args.package[1:]) if args.package else \
        ("megatron-core", args.megatron_core) if args.megatron_core else (None, None)
    if args.repo and not Path(args.repo, ".git").exists():
        raise BadInput(f"--repo {args.repo}: not a git checkout (no .git there)")
    # the selection is planned here too, so bad input is refused before any environment is built; the
    # engine is imported in each candidate's environment (a --repo engine lives in the checkout), not here
    plan(args.suite, args.model, args.world_size, args.layout, baselines_dir=args.baselines_dir,
         **{**_case_kwargs(args), "engine": "mcore"})

    return bisect(args, lambda msg: print(msg, file=sys.stderr, flush=True))


def _bisect_step(args) -> int:
    from harness.bisect import step_main

    return step_main(args)


def _compare(args) -> int:
    from harness.compare import compare_main
    from harness.driver import plan

    if args.suite != "step-perf":
        raise BadInput(f"compare judges step times: --suite step-perf (got {args.suite!r})")
    if args.steps_per_round < 3:
        raise BadInput(f"--steps-per-round must be >= 3, got {args.steps_per_round}")
    if args.rounds < 2:
        raise BadInput(f"--rounds must be >= 2 (interleaving needs several rounds per side), got {args.rounds}")
    for engine in args.engine or ["mcore"]:  # every bad input before any rank starts
        plan(args.suite, args.model, args.world_size, args.layout, **{**_case_kwargs(args), "engine": engine})
    _out_dir(args.out)
    return compare_main(args, lambda msg: print(msg, file=sys.stderr, flush=True))


def _nightly(args) -> int:
    from harness.nightly import SUITES, run_nightly

    if args.world_size is not None and args.world_size < 1:
        raise BadInput(f"--world-size must be >= 1, got {args.world_size}")
    return run_nightly(Path(args.out), args.suite or list(SUITES), args.model, args.world_size, args.backend,
                       args.engine, lambda msg: print(msg, file=sys.stderr, flush=True), label=args.label,
                       history_db=Path(args.history_db) if args.history_db else None)


def _history_db(args) -> Path:
    from harness.history.store import DEFAULT_DB

    return Path(args.db) if args.db else DEFAULT_DB


def _history_ingest(args) -> int:
    from harness.history import store

    if not Path(args.dir).is_dir():
        raise BadInput(f"{args.dir}: not a directory (give a --out directory of harness run / nightly)")
    con = store.open_db(_history_db(args))
    try:
        added, known = store.ingest(con, Path(args.dir))
        n = store.counts(con)
    finally:
        con.close()
    print(f"{_history_db(args)}: {added} runs added, {known} already there; {n['runs']} runs, "
          f"{n['figures']} figures in all")
    return 0


def _history_show(args) -> int:
    from datetime import date

    from harness.history import show, store

    if args.since:
        try:
            date.fromisoformat(args.since)
        except ValueError:
            raise BadInput(f"--since {args.since!r}: give a date YYYY-MM-DD") from None
    from harness.report.files import prepare_out_dir

    db = _history_db(args)
    con = store.open_db(db, create=False)  # a bad database is refused before the plots directory is made
    try:
        plots = prepare_out_dir(Path(args.plots) if args.plots else db.parent / "history-plots", "--plots")
        text, pngs = show.show(con, args.metric, args.case, args.since, plots)
    finally:
        con.close()
    print(text)
    if pngs:
        print(f"trends: {len(pngs)} PNG in {plots}")
    return 0


def _project_memory(args) -> int:
    from harness.checks.memory_model import MIB, project, save_band
    from harness.layouts import validate
    from harness.models import load_model
    from harness.spec import Layout

    model = load_model(args.model)
    layout = validate(Layout.parse(args.layout), model)
    known = ("dp_reshardable", "fully_reshardable", "fully_reshardable_mem_efficient")
    if args.format and args.format not in known:
        raise BadInput(f"--format {args.format!r}: no memory model for it; known: {', '.join(known)}")
    if args.ranks_per_node < 1:
        raise BadInput(f"--ranks-per-node must be >= 1, got {args.ranks_per_node}")
    formats = [args.format] if args.format else list(known)
    projections = [project(fmt, model, layout, args.ranks_per_node) for fmt in formats]
    print(f"model {model.name} ({model.num_params() / 1e9:.2f}B params), layout {layout.id}, "
          f"{args.ranks_per_node} ranks per node")
    for fmt, p in zip(formats, projections):
        band = save_band(fmt, model, layout, p.worst_rank)
        gib = 1024 * MIB
        print(f"{fmt:<34} per rank (worst: rank {p.worst_rank}) {p.per_rank_low / gib:8.1f} - {p.per_rank_high / gib:8.1f} GiB"
              f"   per node up to {p.per_node_high / gib:9.1f} GiB   [{band.why}]")
    print("model: bounds from 12N optimizer state and 4N weights plus a 2 MiB fixed cost measured on CPU ranks; "
          "the ckpt-memory suite checks measured peaks of tiny / small on 4 gloo ranks against these bands "
          "(check 'ckpt-memory.model'); at this scale the figures are an extrapolation, not a measurement")
    return 0


def _add_case_args(p: argparse.ArgumentParser, compare: bool = False) -> None:
    """The flags that select a suite's cases (shared by run, baselines, bisect, compare; compare: the suite
    defaults to step-perf and --engine may be given twice, A then B)."""
    if compare:
        p.add_argument("--suite", default="step-perf", help="step-perf (the suite whose step times are compared)")
        p.add_argument("--engine", action="append", help="A then B (twice), or the engine of both sides (once)")
    else:
        p.add_argument("--suite", required=True, help="equivalence, grad-sync, ckpt-memory, dynamic-cp, step-perf")
    p.add_argument("--model", default=None, help="model spec (default: the suite's CPU model, tiny or small)")
    p.add_argument("--world-size", type=int, default=4, help="ranks per case (default 4)")
    p.add_argument("--layout", action="append", help="layout id (repeatable); default: the suite's matrix")
    if not compare:
        p.add_argument("--engine", default="mcore", help="mcore, or a user engine package.module:factory")
    p.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--distributed-optimizer", action="store_true", help="use_distributed_optimizer=True")
    p.add_argument("--overlap-grad-reduce", action="store_true")
    p.add_argument("--timeout", type=float, default=None, help="per-case timeout in seconds (default 300)")
    p.add_argument("--ckpt-format", action="append", help="ckpt-memory: only these formats (repeatable)")
    p.add_argument("--fully-parallel-save", action="store_true",
                   help="ckpt-memory: save through megatron's FullyParallelSaveStrategyWrapper")
    p.add_argument("--async-save", action="store_true",
                   help="ckpt-memory: megatron's async save (the write in a forked process)")
    p.add_argument("--timed-steps", type=int, default=None, help="step-perf: timed steps per case (default 20)")
    p.add_argument("--min-effect", type=float, default=None,
                   help="step-perf: smallest slowdown that fails, as a fraction (default against baselines 0.15 on "
                        "CPU, 0.05 on GPU; compare, interleaved: 0.05 / 0.03)")


def case_argv(args, skip: tuple[str, ...] = ()) -> list[str]:
    """The shared case-selection flags of parsed args, back as command-line arguments (non-defaults only;
    `skip`: destinations left out)."""
    probe = argparse.ArgumentParser(add_help=False)
    _add_case_args(probe)
    out: list[str] = []
    for action in probe._actions:
        if action.dest in skip:
            continue
        value, flag = getattr(args, action.dest), action.option_strings[0]
        if value is None or value == action.default or value is False:
            continue
        if value is True:
            out.append(flag)
        elif isinstance(value, list):
            out += [x for v in value for x in (flag, str(v))]
        else:
            out += [flag, str(value)]
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="harness", description="Regression harness for Megatron-based training engines.")
    sub = p.add_subparsers(dest="command", required=True)

    lay = sub.add_parser("layouts", help="list the valid TP/PP/CP/DP layouts of a world size for a model")
    lay.add_argument("--world-size", type=int, required=True)
    lay.add_argument("--model", required=True)
    lay.add_argument("--layout", action="append", help="check these layout ids instead of listing all")
    lay.set_defaults(func=_layouts)

    run = sub.add_parser("run", help="run a suite over layouts on local ranks and judge it")
    _add_case_args(run)
    run.add_argument("--out", help="directory for results.json")
    run.add_argument("--label", default=None, help="names this run in reports and the history (e.g. the engine's "
                                                   "branch), so runs of one engine at two versions are told apart")
    run.add_argument("--fresh-ranks", action="store_true",
                     help="start new rank processes for every case instead of reusing warm ones")
    run.add_argument("--shuffle", type=int, metavar="SEED", default=None,
                     help="run the cases in a shuffled order (isolation check)")
    run.add_argument("--baselines-dir", default=None, help="default: the repository's baselines/")
    run.set_defaults(func=_run)

    bl = sub.add_parser("baselines", help="record, check or diff stored baselines",
                        description="record: run the suite --repeats times and store median, spread and tolerance "
                                    "(refused when a metric is too noisy); check: run and compare; diff: the "
                                    "baseline file against git (--against REV, default HEAD) or another file (--old)")
    bl.add_argument("action", choices=["record", "check", "diff"])
    _add_case_args(bl)
    bl.add_argument("--repeats", type=int, default=3)
    bl.add_argument("--baselines-dir", default=None)
    bl.add_argument("--platform", default=None, help="diff: platform key (default: this machine's, e.g. cpu-gloo)")
    bl.add_argument("--against", default="HEAD", help="diff: git revision of the old file (default HEAD)")
    bl.add_argument("--old", default=None, help="diff: compare with this file instead of a git revision")
    bl.set_defaults(func=_baselines)

    rep = sub.add_parser("report", help="render results directories as Markdown, JSON, JUnit XML and PNG plots")
    rep.add_argument("dir", help="a --out directory of `harness run` (every results.json below it is included)")
    rep.set_defaults(func=_report)

    for name, helptext in (("bisect", "find the first megatron-core version or commit where a metric crosses a threshold"),
                           ("bisect-step", "judge the current checkout / environment for `git bisect run` "
                                           "(exit 0 good, 1 bad, 125 cannot tell)")):
        bs = sub.add_parser(name, help=helptext)
        _add_case_args(bs)
        bs.add_argument("--metric", required=True,
                        help="a baselined metric of the suite (e.g. rank0.save_heap_peak_mib; the worst case of the "
                             "selection counts), or 'fail': bad when any case does not pass")
        bs.add_argument("--max", default="fail", help="bad above this: a number, baseline+P%% or baseline+X")
        bs.add_argument("--error-is-bad", action="store_true", help="a case that errors is bad (default: cannot tell)")
        bs.add_argument("--baselines-dir", default=None)
        bs.add_argument("--fresh-ranks", action="store_true")
        if name == "bisect":
            bs.add_argument("--package", nargs="+", metavar="NAME VERSION",
                            help="a distribution, then its releases oldest first (good .. bad) or a range A..B from "
                                 "the package index: megatron-core, megatron-bridge, mbridge, transformer-engine, "
                                 "your framework; each installed --no-deps into a cached environment over this one")
            bs.add_argument("--megatron-core", nargs="+", metavar="VERSION", help="short for --package megatron-core ...")
            bs.add_argument("--repo", help="a local git checkout of the engine (Megatron-LM, your framework)")
            bs.add_argument("--good", help="--repo: a commit without the regression (with --find-fix: the later, fixed one)")
            bs.add_argument("--bad", help="--repo: a later commit with it (with --find-fix: the earlier, broken one)")
            bs.add_argument("--path-in-repo", default=".", help="--repo: the directory put on the path (default: root)")
            bs.add_argument("--cache", default=None, help="virtualenvs and worktrees (default ~/.cache/harness-bisect)")
            bs.add_argument("--find-fix", action="store_true",
                            help="the candidates go from bad to good: find the first good one (when a fix landed)")
            bs.set_defaults(func=_bisect)
        else:
            bs.add_argument("--json", default=None, help="also write the verdict as JSON here")
            bs.set_defaults(func=_bisect_step)

    cmp = sub.add_parser("compare", help="A against B, interleaved in one run: two engines, or this environment "
                                         "against a megatron-core release or a commit (step-perf)")
    _add_case_args(cmp, compare=True)
    cmp.add_argument("--rounds", type=int, default=5, help="rounds per side, A/B order drawn each round (default 5)")
    cmp.add_argument("--steps-per-round", type=int, default=10, help="timed steps per case per round (default 10)")
    cmp.add_argument("--megatron-core", default=None, metavar="VERSION", help="B: this megatron-core release")
    cmp.add_argument("--repo", help="B: a commit of this local checkout (with --rev)")
    cmp.add_argument("--rev", help="--repo: the commit to compare against")
    cmp.add_argument("--path-in-repo", default=".", help="--repo: the directory put on the path (default: root)")
    cmp.add_argument("--cache", default=None, help="environments and worktrees (default ~/.cache/harness-bisect)")
    cmp.add_argument("--order-seed", type=int, default=0, help="seed of the A/B order of the rounds")
    cmp.add_argument("--out", default=None, help="write compare.json here")
    cmp.set_defaults(func=_compare)

    ni = sub.add_parser("nightly", help="every suite x models x construction paths, then the report")
    ni.add_argument("--out", required=True, help="directory for every run's results.json and the report")
    ni.add_argument("--suite", action="append", help="only these suites (repeatable; default: all)")
    ni.add_argument("--model", action="append",
                    help="models (repeatable; 'default' is each suite's own; default: default + small on CPU, "
                         "+ 1b on GPUs)")
    ni.add_argument("--world-size", type=int, default=None, help="default: the node's GPUs, or 4 CPU ranks")
    ni.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    ni.add_argument("--engine", default=None, help="only this engine (default: mcore, and every construction "
                                                   "path for grad-sync)")
    ni.add_argument("--label", default=None, help="names every run of this nightly in the report and the history")
    ni.add_argument("--history-db", default=None, help="the history database every run is ingested into at the end "
                                                       "(default: OUT/history.sqlite)")
    ni.set_defaults(func=_nightly)

    hi = sub.add_parser("history", help="every nightly figure in a SQLite database; trends and change points")
    hsub = hi.add_subparsers(dest="history_command", required=True)
    ing = hsub.add_parser("ingest", help="every results.json below DIR into the database (twice adds nothing)")
    ing.add_argument("dir")
    ing.add_argument("--db", default=None, help="default nightly-out/history.sqlite")
    ing.set_defaults(func=_history_ingest)
    sh = hsub.add_parser("show", help="a metric per case: table, change points, bisect commands, PNG trends")
    sh.add_argument("--metric", required=True, help="e.g. rank0.save_heap_peak_mib, step_time_ms, check:<name>")
    sh.add_argument("--case", default="*", help="glob over case ids (default: every case)")
    sh.add_argument("--since", default=None, help="first night, YYYY-MM-DD")
    sh.add_argument("--db", default=None, help="default nightly-out/history.sqlite")
    sh.add_argument("--plots", default=None, help="directory for one PNG trend per case (default: next to the db)")
    sh.set_defaults(func=_history_show)

    pm = sub.add_parser("project-memory", help="predicted host memory of a checkpoint save at scale")
    pm.add_argument("--model", required=True)
    pm.add_argument("--layout", required=True)
    pm.add_argument("--format", default=None)
    pm.add_argument("--ranks-per-node", type=int, default=8)
    pm.set_defaults(func=_project_memory)
    return p


def _raise_interrupted(signum, frame) -> None:
    raise Interrupted(signum)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # `--engine package.module:factory` resolves against the working directory, as `python -m` would.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    # SIGTERM (CI's timeout or cancel) unwinds like Ctrl-C: runs keep their finished cases (driver.run_suite)
    previous = signal.signal(signal.SIGTERM, _raise_interrupted)
    try:
        return args.func(args)
    except BadInput as exc:
        print(f"harness: error: {exc}", file=sys.stderr)
        return 2
    except (Interrupted, KeyboardInterrupt) as exc:
        stop = exc if isinstance(exc, Interrupted) else Interrupted(signal.SIGINT)
        print(f"harness: interrupted ({stop}); what was written before is kept", file=sys.stderr)
        return stop.exit_code
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
