"""`harness nightly`: every suite x the models x the construction paths at the node's world size, each run's
results.json under one directory, then `harness report` over it. Keeps going after failures."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from harness import schema, stack
from harness.backends import Backend
from harness.engine_names import EngineName
from harness.errors import BadInput, DoesNotApply
from harness.files import atomic_write
from harness.history import nights, store
from harness.history.site import write_site
from harness.outcomes import EXIT_ERRORED, EXIT_FAIL, EXIT_NOTHING_JUDGED, EXIT_PASS
from harness.platform import backend as platform_backend
from harness.platform import resolve_backend
from harness.report import directory
from harness.report.directory import prepare_out_dir, remove_run_files
from harness.report.runs import NIGHT_PLAN
from harness.report.terminal import count_outcomes, format_run
from harness.suite_defs import get_suite
from harness.suite_registry import SUITES as REGISTERED
from harness.tables import table

SUITES = tuple(REGISTERED)  # every registered suite, in the registry's order
# Every construction path through every suite (R2 on each); a pair that does not apply (DoesNotApply: fsdp2 under
# grad-sync, a bridge and a model it cannot map) is reported as such. peft-ckpt's mcore is megatron-bridge.
ENGINES = tuple(EngineName)
PATHS = {"peft-ckpt": (EngineName.MEGATRON_BRIDGE,)}
# On CPU ranks every reference model that runs there: no shipped model or path may raise a false alarm
DEFAULT_MODELS = {"gloo": ("tiny", "small", "tiny-moe", "small-moe", "tiny-qwen3-moe"),
                  "nccl": ("default", "small", "1b-2k")}


@dataclass(frozen=True)
class Item:
    suite: str
    model: str | None  # None: the suite's default model
    engine: str

    @property
    def slug(self) -> str:
        return f"{self.suite}-{self.engine}-{self.model or 'default'}".replace(":", "-")


def clear_earlier_night(out: Path, history_db: Path) -> tuple[int, int] | None:
    """A nightly that reuses --out: the earlier night's runs there ingested into the history database where it does
    not hold them yet (a night stopped before its ingest), then their files removed, so that tonight's page shows
    tonight's runs only (a run planned and not run tonight is not last night's); (runs, added) or None."""

    runs = [p.parent for p in sorted(out.rglob("results.json"))]
    if not runs and not (out / NIGHT_PLAN).exists():
        return None
    con = store.open_db(history_db)
    try:
        added, _ = store.ingest(con, out)
    finally:
        con.close()
    for run in runs:
        remove_run_files(run)
        if run != out and not any(run.iterdir()):
            run.rmdir()
    remove_run_files(out, (NIGHT_PLAN,))
    return len(runs), added


def plan_items(suites: list[str], models: list[str], engine: str | None) -> list[Item]:

    items: list[Item] = []
    for name in suites:
        default = get_suite(name).default_model
        for model in dict.fromkeys(default if m == "default" else m for m in models):
            for eng in ([engine] if engine else PATHS.get(name, ENGINES)):
                items.append(Item(name, model, eng))
    return items


def run_nightly(out: Path, suites: list[str], models: list[str] | None, world_size: int | None, backend: Backend,
                engine: str | None, say: Callable[[str], None], label: str | None = None,
                history_db: Path | None = None) -> int:
    import json

    from harness import driver
    from harness.driver import format_clock

    unknown = sorted(set(suites) - set(SUITES))
    if unknown:
        raise BadInput(f"unknown suite(s) {unknown}; nightly runs {', '.join(SUITES)}")
    gpus = platform_backend.cuda_device_count() if backend in (Backend.AUTO, Backend.NCCL) else 0
    world = world_size or gpus or 4
    backend = resolve_backend(backend, world)
    items = plan_items(suites, list(models or DEFAULT_MODELS[backend]), engine)
    # Every run planned before any rank starts: a run that cannot be planned (a path whose package is
    # missing, a model too large for the world size) is recorded as judging nothing - a failure, not a skip.
    refused: dict[Item, str] = {}
    inapplicable: dict[Item, str] = {}  # pairs the harness knows a path or suite does not do: no failure
    plans: dict[Item, driver.Plan] = {}
    for item in items:
        try:
            plans[item] = driver.plan(item.suite, item.model, world, engine=item.engine, backend=backend,
                                      full_timing=True)  # the history's trends of step times
        except DoesNotApply as exc:
            inapplicable[item] = str(exc)
        except BadInput as exc:
            refused[item] = str(exc)

    history_db = history_db or out / "history.sqlite"
    if history_db.exists():  # a corrupt or foreign database is refused before anything is written
        store.open_db(history_db, create=False).close()
    prepare_out_dir(out)
    earlier = clear_earlier_night(out, history_db)
    if earlier:
        say(f"nightly: {out} held {earlier[0]} runs of an earlier night: in {history_db} ({earlier[1]} added now), "
            "their files removed")
    started = datetime.now(UTC).isoformat(timespec="seconds")  # the runs' results are dated after it
    say(f"nightly: {len(items)} runs at world size {world} ({backend}) into {out}")
    t0, rows, passed, stop, judged = time.monotonic(), [], True, None, False
    failing: list[str] = []  # the verdicts of the runs that did not pass
    for i, item in enumerate(items, 1):
        say(f"== run {i}/{len(items)} ({format_clock(time.monotonic() - t0)} elapsed): "
            f"{item.suite} {item.model} {item.engine}")
        if item in inapplicable:
            rows.append([item.suite, item.model, item.engine, "does not apply", "-", inapplicable[item][:100]])
            say(f"   does not apply: {inapplicable[item]}")
            continue
        try:
            if item in refused:
                raise BadInput(refused[item])
            run = driver.execute(plans[item], out_dir=out / item.slug, label=label)
        except BadInput as exc:  # a path whose package is missing, a corrupt baseline file, ...
            reason = str(exc)
            atomic_write(out / item.slug / "results.json", json.dumps(
                {"schema": schema.RESULTS, "suite": item.suite, "engine": item.engine, "model": item.model,
                 "world_size": world, "backend": backend, "cases": [], "checks": [], "passed": False,
                 "verdict": "nothing judged", "nothing_judged": reason}))
            passed = False
            failing.append("nothing judged")
            rows.append([item.suite, item.model, item.engine, "NOTHING JUDGED", "-", reason[:100]])
            say(f"   nothing judged: {reason}")
            continue
        print(format_run(run), flush=True)
        # a run whose every case this world size cannot run or judge (e.g. dynamic-cp on one GPU) says so and
        # is no failure; the nightly as a whole fails when nothing at all was judged
        # skipped for the world size, not for a missing package
        cannot = run.verdict == "nothing judged" and bool(run.results) and not run.errors and \
            all(r.case.skip_reason or not r.skipped for r in run.results)
        passed &= run.passed or cannot
        if not (run.passed or cannot):
            failing.append(run.verdict)
        judged |= bool(run.conclusive)
        rows.append([item.suite, item.model, item.engine, "pass" if run.passed else
                     "NOT JUDGED HERE" if cannot else run.verdict.upper(),
                     f"{run.wall_s:.0f}s", count_outcomes(run.outcomes())])
        if run.interrupted is not None:  # the finished runs and this one's finished cases are kept
            stop = run.interrupted
            rows += [[it.suite, it.model, it.engine, "NOT RUN", "-", f"nightly {stop}"] for it in items[i:]]
            not_run = items[i:]
            break
    else:
        not_run = []
    # what was planned and not run, which no results file tells: the page says so at its top
    atomic_write(out / NIGHT_PLAN, json.dumps({"started": started, "planned": len(items),
                                               "interrupted": str(stop) if stop else None,
                                               "not_run": [it.slug for it in not_run]}))

    con = store.open_db(history_db)
    try:
        # the page against the earlier nights, before tonight's are added
        written = directory.write_report(out, lambda runs: nights.compare(con, runs))
        added, known = store.ingest(con, out)
        site = write_site(con, out / "site")  # tonight's page and every metric's trend beside the others
    finally:
        con.close()
    say(f"history: {added} runs added to {history_db} ({known} already there); site: {out / 'site' / 'index.html'} "
        f"({site['nights']} nights, {site['changed']} of {site['trends']} series with a change)")
    print("\nnightly summary:")
    print(table(["suite", "model", "engine", "verdict", "wall", "cases"], rows))
    print(f"report: {written['html']} ({written['markdown']}, junit: {written['junit']}); "
          f"{format_clock(time.monotonic() - t0)} in all" + (f"; INTERRUPTED ({stop})" if stop else ""))
    if not judged and not stop:
        print("nightly: NOTHING JUDGED - no run could judge anything at this world size; this is not a pass")
    if stop:
        return stop.exit_code
    if passed and judged:
        return EXIT_PASS
    # every run that did not pass only errored: the environment could not measure, no code regressed
    return EXIT_ERRORED if failing and all(v == "errored" for v in failing) else EXIT_FAIL


def other_stacks(given: list[str]) -> dict[tuple[str, str], str]:
    """(name, python) -> its stack's key (harness.stack.key), for each NAME=PYTHON `--other-stack` gives; BadInput
    for a malformed one, one that does not run the harness or is this very stack, before anything runs."""
    import json
    import re
    import subprocess

    out: dict[tuple[str, str], str] = {}
    for item in given:
        name, sep, python = item.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name) or not python:
            raise BadInput(f"--other-stack {item!r}: give NAME=PYTHON, e.g. previous=.nox/stack-previous/bin/python")
        try:
            proc = subprocess.run([python, "-c", "import json; from harness import stack; "
                                                 "print(json.dumps(stack.components()))"],
                                  capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.SubprocessError) as exc:
            raise BadInput(f"--other-stack {python}: cannot run it ({exc}); give the python of an environment that "
                           "has the harness installed (nox -s nightly makes .nox/stack-previous)") from None
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["?"])[-1]
            raise BadInput(f"--other-stack {python}: the harness does not import there ({last}); install it "
                           "(pip install -e .) or give another environment's python")
        key = stack.key(json.loads(proc.stdout))
        if key == stack.key() or key in out.values():
            raise BadInput(f"--other-stack {python}: its stack ({key}) is one the nightly already runs")
        out[(name, python)] = key
    return out


def worst_exit(codes: list[int]) -> int:
    """One exit code for nightlies run on several stacks: an interruption, else a failure, else errors only, else
    nothing judged, else a pass; a stack's process killed by a signal (a negative code) as 128 + the signal."""
    codes = [128 - c if c < 0 else c for c in codes]
    for code in (143, 130, EXIT_FAIL, EXIT_ERRORED, EXIT_NOTHING_JUDGED):
        if code in codes:
            return code
    return next((c for c in codes if c), EXIT_PASS)
