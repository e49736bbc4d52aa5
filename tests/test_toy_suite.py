"""Adding a suite touches only its own module and the registry: tests/fakes/toy_suite.py, registered here
in harness.suite_registry.SUITES, runs through `harness run`, the driver's parameters and judging, and
`harness report`, which renders its results.json in a process where neither torch nor any suite
module can be imported."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from harness import suite_defs, suite_registry
from harness.cli import main
from harness.driver import run_suite
from harness.errors import BadInput


@pytest.fixture
def toy_registered(monkeypatch):
    monkeypatch.setitem(suite_registry.SUITES, "toy", suite_registry.SuiteSpec(
        "tests.fakes.toy_suite:ToySuite", params=("tests.fakes.toy_suite:ToyParams", "tests.fakes.toy_suite:ToyCaseParams")))


@pytest.mark.slow
def test_a_registered_toy_suite_runs_through_the_cli(toy_registered, tmp_path, capsys):
    code = main(["run", "--suite", "toy", "--world-size", "2", "--backend", "gloo", "--fresh-ranks",
                 "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    data = json.loads((tmp_path / "results.json").read_text())
    assert [c["outcome"] for c in data["cases"]] == ["pass", "pass"]
    assert [c["params"] for c in data["cases"]] == [{"index": 0, "offset": 0.0}, {"index": 1, "offset": 0.0}]
    assert data["cases"][1]["variant"] == "index=1" and data["cases"][0]["metrics"] == {"sum": 1.0}
    assert "toy: 2 checks passed, 0 failed" in out


@pytest.mark.slow
def test_the_toy_suites_planted_regression_fails_its_check(toy_registered):
    run = run_suite("toy", None, 2, backend="gloo", fresh_ranks=True, suite_params={"offset": 0.5, "cases": 1})
    (check,) = run.checks
    assert run.exit_code == 1 and not check.passed
    assert check.message == "all-reduced sum 2 != 1 (error 1)"


def test_a_parameter_the_suite_does_not_have_is_refused(toy_registered):
    with pytest.raises(BadInput, match="^--timed-steps does not apply to the toy suite$"):
        run_suite("toy", None, 2, backend="gloo", suite_params={"timed_steps": 5})


# A process where torch, megatron and every suite module fail to import: what `harness report` needs
# of a run is in its results.json. The suites' parameter types stay importable (plain dataclasses, the CLI's
# flags): their modules, the packages' __init__ that import them (each suite's SuiteSpec.params), and the registry.
PARAM_MODULES = tuple(name for module, _, _ in (t.partition(":") for spec in suite_registry.SUITES.values()
                                                for t in spec.params)
                      for name in (module.rpartition(".")[0], module))
_NO_TORCH = textwrap.dedent("""
    import sys
    PARAM_MODULES = @PARAM_MODULES@

    class Refuse:
        BLOCKED = ("torch", "megatron", "harness.suite_defs", "harness.driver", "harness.launch", "tests.fakes.toy_suite")
        PARAMS = ("harness.suite_defs", "harness.suite_flags") + PARAM_MODULES

        def find_spec(self, name, path=None, target=None):
            if name not in self.PARAMS and any(name == b or name.startswith(b + ".") for b in self.BLOCKED):
                raise ImportError(f"{name} is hidden in this test")
            return None

    sys.meta_path.insert(0, Refuse())
""").replace("@PARAM_MODULES@", repr(PARAM_MODULES))


@pytest.mark.slow
def test_report_renders_from_results_json_without_torch_or_suites(toy_registered, tmp_path):
    run = run_suite("toy", None, 2, backend="gloo", fresh_ranks=True, out_dir=tmp_path / "run",
                    suite_params={"offset": 0.5, "cases": 1})
    from harness.report.terminal import format_run

    printed = format_run(run)
    script = _NO_TORCH + textwrap.dedent(f"""
        import json
        from harness.report.terminal import format_results
        from harness.cli import main

        data = json.loads(open({str(tmp_path / "run" / "results.json")!r}).read())
        print(format_results(data) + "\\n--- report")
        print("--- exit", main(["report", {str(tmp_path / "run")!r}]))
        for hidden in ("harness.suite_defs.golden.suite", "harness.suite_defs.equivalence", "torch"):
            try:
                __import__(hidden)
                raise SystemExit(f"{{hidden}} imported")
            except ImportError:
                pass
        assert not any(m == "torch" or m.startswith("torch.") or m.startswith("harness.suite_defs")
                       and m not in Refuse.PARAMS for m in sys.modules), sorted(sys.modules)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rendered, _, tail = proc.stdout.partition("\n--- report\n")
    assert tail.strip().endswith("--- exit 0"), tail
    assert rendered == printed  # the same report as the live run printed, from data alone
    assert "FAIL toy.sum" in rendered and "all-reduced sum 2 != 1 (error 1)" in rendered
    md = (tmp_path / "run" / "report.md").read_text()
    assert "all-reduced sum 2 != 1" in md


def test_a_suite_parameter_is_declared_once_on_its_type(toy_registered, monkeypatch):
    """ToyParams.offset declares its flag in its field's metadata; with the type listed on the toy suite's registry
    line, the CLI has the option, the selection carries the value, to_argv and a case's variant give the flag
    again, and another suite refuses it naming the flag."""
    import dataclasses

    from harness import cli
    from harness.selection import CaseSelection, variant_argv
    from harness.driver import plan

    argv = ["run", "--suite", "toy", "--world-size", "2", "--toy-offset", "0.5"]
    sel = CaseSelection.from_args(cli.build_parser().parse_args(argv))
    assert sel.suite_params == {"offset": 0.5}
    assert sel.to_argv() == argv[1:]
    planned = plan(dataclasses.replace(sel, backend="gloo"))
    assert [c.params.offset for c in planned.cases] == [0.5, 0.5]
    assert variant_argv(planned.cases[1].variant) == ["--toy-offset", "0.5"]
    with pytest.raises(BadInput, match="^--toy-offset does not apply to the equivalence suite$"):
        plan("equivalence", "tiny", 2, backend="gloo", suite_params=sel.suite_params)


def test_every_suite_parameter_type_with_flags_is_listed():
    import dataclasses

    from harness.suite_flags import param_types

    listed = set(param_types())
    for name in suite_registry.SUITES:
        params = getattr(suite_defs.get_suite(name), "Params", None)
        if params is not None and any("flag" in f.metadata for f in dataclasses.fields(params)):
            assert params in listed, f"{name}: {params.__qualname__} declares flags: list it in its SuiteSpec.params"
