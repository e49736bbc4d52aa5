"""harness bisect: the search and its reproduction gate, thresholds, version ranges, and a real bisect over
a local git history in which one commit plants a host-memory regression in the save path."""

from __future__ import annotations

import re
import subprocess

import pytest

from harness import cli
from harness.bisect import BAD, GOOD, SKIP, GateRefused, StepResult, Threshold, expand_versions, search
from harness.errors import BadInput


def _judge(verdicts):
    calls = []

    def judge(i):
        calls.append(i)
        return StepResult(verdicts[i], value=float(i), threshold=2.5, why=f"candidate {i}")
    return judge, calls


def test_search_finds_the_first_bad_after_the_gate():
    judge, calls = _judge([GOOD] * 5 + [BAD] * 4)
    first, tried = search([f"c{i}" for i in range(9)], judge, lambda msg: None)
    assert first == 5
    assert calls[:2] == [8, 0]  # the gate: the bad end first, then the good end
    assert len(calls) <= 2 + 3  # log2(7) steps after the gate
    assert [t.role for t in tried[:2]] == ["gate: bad", "gate: good"]


def test_search_steps_around_candidates_it_cannot_judge():
    judge, calls = _judge([GOOD, GOOD, SKIP, SKIP, BAD, BAD])
    first, _ = search(list("abcdef"), judge, lambda msg: None)
    assert first == 4 and 2 in calls and 3 in calls


def test_gate_refuses_a_pair_that_does_not_reproduce():
    judge, calls = _judge([GOOD, GOOD, GOOD])
    with pytest.raises(GateRefused, match="the bad end c does not reproduce: good"):
        search(list("abc"), judge, lambda msg: None)
    assert calls == [2]
    judge, _ = _judge([BAD, BAD, BAD])
    with pytest.raises(GateRefused, match="the good end a is not good: BAD"):
        search(list("abc"), judge, lambda msg: None)


def test_thresholds():
    assert Threshold("40").resolve(None) == 40.0
    assert Threshold("baseline+10%").resolve(30.0) == pytest.approx(33.0)
    assert Threshold("baseline + 5").resolve(30.0) == 35.0
    with pytest.raises(BadInput, match="no stored baseline"):
        Threshold("baseline+10%").resolve(None)
    with pytest.raises(BadInput, match="give a number, baseline"):
        Threshold("lots")


def test_version_ranges_come_from_the_index():
    index = ["0.14.0", "0.15.0", "0.15.3", "0.16.0rc1", "0.16.0", "0.16.1"]
    assert expand_versions(["0.15.0..0.16.1"], lambda: index) == ["0.15.0", "0.15.3", "0.16.0", "0.16.1"]
    assert expand_versions(["0.16.0", "0.16.1"], lambda: index) == ["0.16.0", "0.16.1"]
    with pytest.raises(BadInput, match="at least a good and a bad"):
        expand_versions(["0.16.1"], lambda: index)
    with pytest.raises(BadInput, match="not a version"):
        expand_versions(["latest", "0.16.1"], lambda: index)


ENGINE = '''\
"""An engine under development (the user's framework, in miniature)."""
from harness.engines.mcore import McoreEngine

SAVE_SCRATCH_MIB = {scratch}


class Engine(McoreEngine):
    def save_checkpoint(self, ckpt_dir, fmt, fully_parallel=False, async_save=False):
        import torch

        staging = torch.ones(SAVE_SCRATCH_MIB * 2**18) if SAVE_SCRATCH_MIB else None  # float32: 4 bytes
        super().save_checkpoint(ckpt_dir, fmt, fully_parallel, async_save)
        del staging
'''


def _git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture(scope="module")
def engine_repo(tmp_path_factory):
    """Five commits; the third stages a 48 MiB host copy in the save path."""
    repo = tmp_path_factory.mktemp("engine-repo")
    _git(repo, "init", "-q")
    _git(repo, "config", "user.email", "dev@example.com")
    _git(repo, "config", "user.name", "dev")
    shas = []
    for subject, scratch, extra in [("engine: first version", 0, ""), ("engine: docs", 0, "# saves with dist_checkpointing\n"),
                                    ("engine: stage the save in a scratch buffer", 48, "# saves with dist_checkpointing\n"),
                                    ("engine: rename", 48, "# saves with megatron dist_checkpointing\n"),
                                    ("engine: more docs", 48, "# saves with megatron dist_checkpointing (sync)\n")]:
        (repo / "regress_engine.py").write_text(ENGINE.format(scratch=scratch) + extra)
        _git(repo, "add", "regress_engine.py")
        _git(repo, "commit", "-q", "-m", subject)
        shas.append(_git(repo, "rev-parse", "HEAD"))
    return repo, shas


CASE = ["--suite", "ckpt-memory", "--model", "tiny", "--world-size", "2", "--layout", "tp1-pp1-cp1-dp2",
        "--ckpt-format", "dp_reshardable", "--engine", "regress_engine:Engine",
        "--metric", "rank0.save_heap_peak_mib", "--max", "24"]


@pytest.mark.slow
def test_bisect_names_the_commit_that_planted_the_regression(engine_repo, tmp_path, capsys, no_leftover_ranks):
    repo, shas = engine_repo
    # commits 1..3: the two gates and one step (the search's own steps are test_search_finds_the_first_bad_after_the_gate's)
    code = cli.main(["bisect", "--repo", str(repo), "--good", shas[1], "--bad", shas[3], "--cache", str(tmp_path), *CASE])
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"first bad: {shas[2][:10]} engine: stage the save in a scratch buffer (rank0.save_heap_peak_mib " in out
    assert f"last good: {shas[1][:10]}" in out
    table = out.split("first bad:")[0]
    rows = {}  # candidate sha -> (tried as, verdict); columns are separated by 2+ spaces
    for line in table.splitlines():
        cols = re.split(r"\s{2,}", line.strip())
        if cols and cols[0][:10] in {sha[:10] for sha in shas}:
            rows[cols[0][:10]] = (cols[1], cols[5])
    # gates at both ends, then the commit between them; commits 0 and 4 are outside the range
    assert rows == {shas[1][:10]: ("gate: good", "good"), shas[3][:10]: ("gate: bad", "BAD"),
                    shas[2][:10]: ("step 1", "BAD <- first bad")}, table
    assert _git(repo, "worktree", "list").count("\n") == 0  # the bisect worktree is gone


@pytest.mark.slow
@pytest.mark.nightly  # the gate's refusal: test_gate_refuses_a_pair_that_does_not_reproduce; the real gates: above
def test_bisect_refuses_a_pair_that_does_not_reproduce(engine_repo, tmp_path, capsys):
    repo, shas = engine_repo
    code = cli.main(["bisect", "--repo", str(repo), "--good", shas[0], "--bad", shas[1], "--cache", str(tmp_path), *CASE])
    captured = capsys.readouterr()
    assert code == 2
    assert f"harness: error: the bad end {shas[1][:10]} engine: docs does not reproduce: good (rank0.save_heap_peak_mib " \
        in captured.err


@pytest.mark.slow
@pytest.mark.nightly
def test_git_bisect_run_names_the_same_commit(engine_repo, tmp_path, capsys, no_leftover_ranks):
    repo, shas = engine_repo
    code = cli.main(["bisect", "--repo", str(repo), "--good", shas[0], "--bad", shas[-1], "--cache", str(tmp_path),
                     "--git-bisect-run", *CASE])
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"first bad: {shas[2][:10]} engine: stage the save in a scratch buffer (rank0.save_heap_peak_mib " in out
    assert f"last good: {shas[1][:10]}" in out
    tried = {line.split()[0]: line for line in out.split("first bad:")[0].splitlines() if "git bisect" in line}
    assert shas[2][:10] in tried and "<- first bad" in tried[shas[2][:10]], out  # judged by a git bisect step
    assert _git(repo, "worktree", "list").count("\n") == 0


def test_bisect_step_for_git_bisect_run_refuses_bad_input(capsys):
    assert cli.main(["bisect-step", "--suite", "ckpt-memory", "--metric", "x", "--max", "lots"]) == 2
    assert "--max 'lots': give a number" in capsys.readouterr().err


def test_each_step_gets_the_same_case_selection():
    from harness.commands.bisect_command import _spec
    from harness.selection import CaseSelection

    argv = ["--suite", "ckpt-memory", "--layout", "tp1-pp1-cp1-dp4", "--layout", "tp2-pp1-cp1-dp2",
            "--ckpt-format", "default", "--fully-parallel-save", "--model", "small", "--world-size", "2"]
    args = cli.build_parser().parse_args(["bisect", *argv, "--metric", "fail", "--error-is-bad",
                                          "--megatron-core", "0.16.0", "0.16.1"])
    sel = CaseSelection.from_args(args)
    step = cli.build_parser().parse_args(_spec(args, sel).command()[2:])
    assert step.command == "bisect-step" and step.metric == "fail" and step.error_is_bad and not step.find_fix
    assert CaseSelection.from_args(step) == sel and set(sel.to_argv()) == set(argv)


def test_versions_of_a_wheel_directory_come_from_the_file_names(tmp_path, monkeypatch):
    from harness.bisect import index_versions

    for name in ["regress_engine-1.0.0-py3-none-any.whl", "regress_engine-1.10.0-py3-none-any.whl",
                 "regress_engine-1.2.0rc1-py3-none-any.whl", "Regress.Engine-1.2.0-py3-none-any.whl",
                 "regress_engine-0.9.tar.gz", "other_engine-5.0-py3-none-any.whl", "notes.txt", "broken.whl"]:
        (tmp_path / name).write_text("")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    assert index_versions("regress-engine") == ["0.9", "1.0.0", "1.2.0", "1.10.0"]  # sorted as versions
    assert index_versions("regress_engine", prereleases=True) == ["0.9", "1.0.0", "1.2.0rc1", "1.2.0", "1.10.0"]
    with pytest.raises(BadInput, match="no index .PIP_NO_INDEX. and no nothing-here wheel"):
        index_versions("nothing-here")


def test_versions_on_the_index_leave_out_yanked_and_pre_releases(monkeypatch):
    import io
    import json

    from harness.bisect import candidates

    releases = {"0.15.0": [{"yanked": False}], "0.15.1": [{"yanked": True}], "0.15.2": [],
                "0.16.0rc1": [{"yanked": False}], "0.16.0": [{"yanked": True}, {"yanked": False}], "junk": [{}]}
    urls = []

    def urlopen(url, timeout):
        urls.append(url)
        return io.BytesIO(json.dumps({"releases": releases}).encode())

    monkeypatch.setattr("urllib.request.urlopen", urlopen)
    monkeypatch.delenv("PIP_NO_INDEX", raising=False)
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    assert candidates.index_versions("megatron-core") == ["0.15.0", "0.16.0"]
    assert candidates.index_versions("megatron-core", prereleases=True) == ["0.15.0", "0.16.0rc1", "0.16.0"]
    assert urls[0] == "https://pypi.org/pypi/megatron-core/json"

    def offline(url, timeout):
        import urllib.error

        raise urllib.error.URLError("no network")

    monkeypatch.setattr("urllib.request.urlopen", offline)
    with pytest.raises(BadInput, match="cannot list megatron-core versions from the package index: .*no network"):
        candidates.index_versions("megatron-core")


def _wheel(directory, name: str, version: str, module: str, source: str) -> None:
    """A pure-Python wheel of one module, written as pip writes one (METADATA, WHEEL, RECORD with hashes):
    `pip wheel` of a setuptools project took 3 s a wheel."""
    import base64
    import hashlib
    import zipfile

    dist = f"{name.replace('-', '_')}-{version}"
    files = {f"{module}.py": source,
             f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\n"
                                        "Tag: py3-none-any\n"}
    record = [f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()},"
              f"{len(text.encode())}" for path, text in files.items()]
    files[f"{dist}.dist-info/RECORD"] = "\n".join([*record, f"{dist}.dist-info/RECORD,,"]) + "\n"
    with zipfile.ZipFile(directory / f"{dist}-py3-none-any.whl", "w") as whl:
        for path, text in files.items():
            whl.writestr(path, text)


@pytest.fixture(scope="module")
def engine_wheels(tmp_path_factory):
    """regress-engine 1.0.0 .. 1.2.0 as wheels in a local directory (the package index of the test); 1.2.0
    stages a 48 MiB host copy in the save path."""
    wheels = tmp_path_factory.mktemp("wheels")
    for version, scratch in [("1.0.0", 0), ("1.1.0", 0), ("1.2.0", 48)]:
        _wheel(wheels, "regress-engine", version, "regress_engine", ENGINE.format(scratch=scratch))
    return wheels


@pytest.mark.slow
def test_bisect_over_a_package_names_the_release(engine_wheels, tmp_path, capsys, monkeypatch, no_leftover_ranks):
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # versions listed from / pip install reads the wheel directory only
    monkeypatch.setenv("PIP_FIND_LINKS", str(engine_wheels))
    # three releases: the two gates and one step (the search itself is the git bisect tests')
    code = cli.main(["bisect", "--package", "regress-engine", "1.0.0..1.2.0", "--cache", str(tmp_path), *CASE])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "first bad: 1.2.0 (rank0.save_heap_peak_mib " in out, out
    assert "last good: 1.1.0" in out
    assert re.split(r"\s{2,}", out.splitlines()[0])[2] == "regress-engine"  # the version column is the package's


def test_a_check_metric_is_bad_where_the_check_does_not_pass():
    """`--metric check:<suite>.<check>`: a known upstream defect reported as inconclusive is bad, the release whose
    fix makes the check pass is good (`--find-fix` finds it), a run where the check did not run cannot tell."""
    from types import SimpleNamespace

    from harness.bisect.search import BAD, GOOD, SKIP
    from harness.bisect.step import _judge_check
    from harness.checks import CheckResult, cannot_tell

    name = "rl-cycle.upstream-bias"
    run = SimpleNamespace(checks=[cannot_tell(name, "c1", "known upstream defect (NVIDIA/Megatron-LM#4785)")],
                          outcomes=lambda: [])
    step = _judge_check(run, name, False, {})
    assert step.verdict == BAD and step.why.startswith(f"{name} inconclusive: cannot tell: known upstream defect")
    run.checks = [CheckResult(name, "c1", True, "held"), CheckResult("rl-cycle.replay", "c1", False, "wrong")]
    assert _judge_check(run, name, False, {}).verdict == GOOD
    run.checks = [CheckResult(name, "c1", False, "moved")]
    assert _judge_check(run, name, False, {}).verdict == BAD
    run.checks = []
    assert _judge_check(run, name, False, {}).verdict == SKIP
