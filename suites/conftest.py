"""pytest options of the regression suites: --world-size, --backend, --model, --results-dir, baselines."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.baselines import BASELINES_DIR_FLAG
from harness.selection import SHARED_FLAGS
from harness.suite_flags import param_flags


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("harness")
    for name, keywords in SHARED_FLAGS.items():  # declared once, for the CLI and here
        g.addoption(name, **keywords)
    g.addoption("--results-dir", default=None, help="write <suite>/results.json per suite here")
    g.addoption("--baselines-dir", **BASELINES_DIR_FLAG)
    g.addoption("--update-baselines", action="store_true", help="record baselines instead of comparing")
    g.addoption("--fresh-ranks", action="store_true", help="new rank processes per case (no warm pool)")
    g.addoption("--default-models-only", action="store_true",
                help="each suite on its default model only: the runs on a second model (the MoE models beside a "
                     "dense suite's own) are skipped (the previous stack's subset in CI)")
    [min_effect] = [pf for pf in param_flags() if pf.field == "min_effect"]  # declared once, on StepPerfParams
    min_effect.add_to(g.addoption)


def pytest_report_header(config: pytest.Config) -> list[str]:
    """The stack the suites judge (and a megatron-core outside the tested range, in one line)."""
    from harness import stack

    warning = stack.untested_warning()
    return [f"harness stack: {stack.describe()} ({stack.key()})", *([warning] if warning else [])]


def pytest_configure(config: pytest.Config) -> None:
    for marker in ("cpu: runs on CPU ranks (gloo)", "gpu: needs GPUs (NCCL)",
                   "slow: starts ranks", "nightly: full matrix, nightly only"):
        config.addinivalue_line("markers", marker)


@pytest.fixture(scope="session")
def harness_opts(request: pytest.FixtureRequest) -> dict:
    c = request.config
    return {
        "world_size": c.getoption("--world-size"), "backend": c.getoption("--backend"),
        "model": c.getoption("--model"), "engine": c.getoption("--engine"),
        "results_dir": c.getoption("--results-dir"), "fresh_ranks": c.getoption("--fresh-ranks"),
        "default_models_only": c.getoption("--default-models-only"),
    }


_REPORTS = pytest.StashKey[list]()


@pytest.fixture(scope="session")
def publish(request: pytest.FixtureRequest):
    """Suites hand their formatted tables here; they are printed in pytest's terminal summary."""
    reports = request.config.stash.setdefault(_REPORTS, [])
    return reports.append


@pytest.fixture(scope="session")
def suite_runner(request: pytest.FixtureRequest, harness_opts: dict, publish):
    """run(suite, engine=None, label=None, suite_params=None, model=None, layouts=None) -> SuiteRun: the suite with
    the session's options (model: another than --model's, e.g. an MoE model beside the suite's own; layouts: ids
    instead of the suite's matrix), its table
    published and its results written. With --update-baselines a suite that has baselines is recorded
    first (3 repeats), then run again against the new file. A missing dependency skips the test."""
    from harness.driver import run_suite
    from harness.errors import DoesNotFit, MissingDependency, NotOnThisStack
    from harness.launch.machine_lock import share_machine
    from harness.report.results_file import write_results
    from harness.report.terminal import format_run
    from harness.suite_defs import get_suite, runs_alone

    c = request.config
    baselines_dir = c.getoption("--baselines-dir")

    def run(name, engine: str | None = None, label: str | None = None, suite_params: dict | None = None,
            model: str | None = None, layouts: list[str] | None = None):
        if model is not None and harness_opts["default_models_only"]:
            pytest.skip(f"{name} on {model}: --default-models-only runs each suite on its default model")
        engine = engine or harness_opts["engine"]
        suite_params = dict(suite_params or {})
        params_type = getattr(get_suite(name), "Params", None)
        min_effect = c.getoption("--min-effect")  # None: the suite's own default, as from the CLI
        if min_effect is not None and "min_effect" in getattr(params_type, "__dataclass_fields__", {}):
            suite_params["min_effect"] = min_effect
        common = dict(engine=engine, backend=harness_opts["backend"], baselines_dir=baselines_dir,
                      suite_params=suite_params)

        def run_or_record():
            if c.getoption("--update-baselines") and hasattr(get_suite(name), "samples"):
                from harness.recording import record_suite

                path, diff = record_suite(name, model or harness_opts["model"], harness_opts["world_size"],
                                          **common)
                publish(f"recorded {path}:\n{diff}")
            return run_suite(name, model or harness_opts["model"], harness_opts["world_size"], layouts,
                             fresh_ranks=harness_opts["fresh_ranks"], **common)

        try:
            with share_machine(runs_alone(get_suite(name))):  # beside another xdist worker's runs, or alone
                result = run_or_record()
        # not installed here / a path the installed releases cannot run together / predicted not to fit this device
        except (MissingDependency, NotOnThisStack, DoesNotFit) as exc:
            pytest.skip(str(exc))
        if result.interrupted is not None:
            raise KeyboardInterrupt(str(result.interrupted))  # pytest stops the session
        publish(format_run(result))
        if harness_opts["results_dir"]:
            slug = label or (name if isinstance(name, str) else result.suite.name)
            write_results(result, Path(harness_opts["results_dir"]) / slug)
        if result.results and all(r.skipped for r in result.results):  # e.g. needs more ranks than given
            pytest.skip(f"{result.suite.name}: " + "; ".join(dict.fromkeys(r.error.splitlines()[0]
                                                                        for r in result.results)))
        return result

    return run


def failures(run, check: str | None = None) -> str:
    """Every failed check (of one name) with its details, and every case error, for an assertion message."""
    lines = [f"{c.case_id}: {c.check}: {c.message}\n" + "\n".join(c.details[:12])
             for c in run.checks if c.failed and (check is None or c.check == check)]
    if check is None:
        lines += [r.error for r in run.results if r.error and not r.skipped]
        lines += [f"{o.result.case.id}: {o.outcome}: {o.reason}" for o in run.outcomes() if o.outcome == "unjudged"]
    return "\n".join(lines)


_JUDGED = pytest.StashKey[list]()


@pytest.fixture(scope="session")
def skip_off_cpu(harness_opts: dict):
    """skip_off_cpu(suite, model, what): skips unless the session runs gloo ranks, where `what` (the model's figures
    the suite judges) is recorded, naming the command that records this platform's."""
    from harness.platform import resolve_backend
    from harness.selection import CaseSelection

    def skip(suite: str, model: str, what: str) -> None:
        backend = resolve_backend(harness_opts["backend"], harness_opts["world_size"])
        if backend != "gloo":
            pytest.skip(f"{what} is recorded for CPU ranks only; record this platform's with: "
                        + CaseSelection(suite, model, harness_opts["world_size"], backend=backend).record_command())

    return skip


def assert_judged(run, check: str | None = None) -> None:
    """The `judge` fixture's assertion (below); returns where the run, or its `check`, was judged and passed."""
    judged = [c for c in run.checks if check is None or c.check == check]
    skipped = [r for r in run.results if r.skipped]
    if not judged and skipped:
        pytest.skip(f"no {check or 'check'} ran: " + "; ".join(dict.fromkeys(r.error.splitlines()[0] for r in skipped)))
    assert judged, (f"{run.suite.name}: no {check or 'check'} ran "
                    f"({len(run.results)} cases: {', '.join(o.outcome for o in run.outcomes()) or 'none'})")
    if check is None:
        assert run.passed or run.verdict == "nothing judged" and not run.errors and not any(
            c.failed for c in run.checks), f"{run.suite.name}: verdict {run.verdict}\n" + failures(run)
    else:
        assert not any(c.failed for c in judged), failures(run, check)
    if all(c.inconclusive for c in judged):
        pytest.skip(f"cannot tell here: {judged[0].case_id}: {judged[0].check}: {judged[0].message}")


@pytest.fixture(scope="session")
def judge(request: pytest.FixtureRequest):
    """judge(run) asserts the whole run: something was judged, every case ran and was judged, every
    check passed. judge(run, "suite.check") asserts one check: it ran at least once and never failed.
    A suite module asserts the whole run once, so no check it runs can be ignored.

    What cannot be judged here is skipped, saying why, never passed: a check every one of whose results
    could not tell right from wrong (inconclusive), or that did not run because the cases it judges were
    skipped (e.g. they need more ranks than --world-size)."""
    judged_runs = request.config.stash.setdefault(_JUDGED, [])

    def judge_and_count(run, check: str | None = None) -> None:
        assert_judged(run, check)
        judged_runs.append(run.suite.name)

    return judge_and_count


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """pytest-xdist's controller: a worker's suite reports and judged runs (sent at its sessionfinish) join its own."""
    out = getattr(node, "workeroutput", {})
    node.config.stash.setdefault(_REPORTS, []).extend(out.get("harness_reports", []))
    node.config.stash.setdefault(_JUDGED, []).extend(out.get("harness_judged", []))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A session of the suites in which nothing at all was judged (every suite skipped or inconclusive,
    e.g. world size 1 for suites that compare layouts) is not a pass: exit 5, as pytest's "no tests".
    A pytest-xdist worker hands its reports and judged runs to the controller, which decides."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["harness_reports"] = list(session.config.stash.get(_REPORTS, []))
        workeroutput["harness_judged"] = list(session.config.stash.get(_JUDGED, []))
        return
    ran_suites = session.config.stash.get(_REPORTS, [])
    if exitstatus == 0 and ran_suites and not session.config.stash.get(_JUDGED, []):
        session.exitstatus = pytest.ExitCode.NO_TESTS_COLLECTED
        tr = session.config.pluginmanager.get_plugin("terminalreporter")
        if tr is not None:
            tr.write_line("harness: NOTHING JUDGED - every suite run was skipped or could not tell right from wrong "
                          "at this world size; this is not a pass (exit 5)", red=True)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    for text in config.stash.get(_REPORTS, []):
        terminalreporter.write_sep("=", "harness report")
        terminalreporter.write_line(text)
