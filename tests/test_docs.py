"""The documentation stays true: every `harness` command line in README.md and docs/ parses with the harness's own
parser, every repository file and page it cites exists, the README stays short, and the counts it claims are the
tests' own. Comments and docstrings in the code cite files that exist in this repository."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 200
# a repository path: a top-level folder of ours followed by a file name with an extension
CITED = re.compile(r"\b((?:docs|harness|tests|suites|baselines)/[\w./-]*\.(?:md|py|json|toml))\b")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _sources() -> list[Path]:
    return [p for d in ("harness", "tests", "suites") for p in (ROOT / d).rglob("*.py")] + [ROOT / "noxfile.py"]


def _docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def harness_commands(text: str) -> list[tuple[int, str]]:
    """(line number, command) of every `harness ...` line in a Markdown text: in fenced shell blocks (```bash;
    continuation lines joined, comments dropped) and in inline code spans."""
    out: list[tuple[int, str]] = []
    fenced, shell, pending, start = False, False, "", 0
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced, shell = not fenced, line.strip()[3:] in ("bash", "sh", "shell", "console")
            continue
        if fenced and not shell:
            continue
        if fenced:
            code = pending + line.split(" #")[0].strip() if pending else line.split(" #")[0].strip()
            if pending or code.startswith("harness "):
                start = start if pending else n
                if code.endswith("\\"):
                    pending = code[:-1] + " "
                    continue
                out.append((start, code))
            pending = ""
            continue
        out += [(n, span) for span in re.findall(r"`(harness [^`]+)`", line)]
    return out


def test_command_lines_are_found_in_fenced_blocks_and_inline_spans():
    text = ("run `harness layouts --world-size 2`, or:\n```bash\nharness run --suite golden \\\n"
            "    --world-size 4   # a comment\nnox -s tests\n```\n")
    assert harness_commands(text) == [(1, "harness layouts --world-size 2"),
                                      (3, "harness run --suite golden  --world-size 4")]


def _parse_error(command: str) -> str:
    """What the harness's parser says of a command line ("" when it parses)."""
    import contextlib
    import io

    from harness.cli import build_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            build_parser().parse_args(shlex.split(command)[1:])
    except SystemExit as exc:
        return err.getvalue().strip().splitlines()[-1] if exc.code else ""
    return ""


def test_every_harness_command_in_the_docs_parses():
    bad = [f"{path.relative_to(ROOT)}:{n}: {cmd}: {why}" for path in _docs()
           for n, cmd in harness_commands(path.read_text()) for why in [_parse_error(cmd)] if why]
    found = sum(len(harness_commands(p.read_text())) for p in _docs())
    assert found >= 40, found  # the docs are read, not skipped
    assert not bad, "\n".join(bad)


def test_a_renamed_flag_in_a_command_line_is_caught():
    assert _parse_error("harness run --suite golden --world-size 4") == ""
    assert "unrecognized arguments: --worldsize 4" in _parse_error("harness run --suite golden --worldsize 4")


def test_the_readme_stays_short():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines: topics belong in docs/ (at most {README_MAX_LINES})"


@pytest.mark.parametrize("path", _sources() + _docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_cited_repository_files_exist(path):
    missing = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        for cited in CITED.findall(line):
            if "<" in cited or "*" in cited:
                continue  # a pattern, e.g. baselines/<platform>/<suite>.json
            if not (ROOT / cited).exists():
                missing.append(f"{path.relative_to(ROOT)}:{n}: {cited}")
        if path.suffix == ".md":
            missing += [f"{path.relative_to(ROOT)}:{n}: link {target}" for target in LINK.findall(line)
                        if "://" not in target and not (path.parent / target).exists()]
    assert not missing, "\n".join(missing)


def test_no_citation_leaves_the_repository():
    outside = [f"{p.relative_to(ROOT)}:{n}" for p in _sources() + _docs()
               for n, line in enumerate(p.read_text().splitlines(), 1) if "../shared/" in line and p.name != "test_docs.py"]
    assert not outside, outside


def test_the_docs_speak_of_the_harness_not_of_how_it_is_developed():
    """'session' is nox's, pytest's or a process's; no other sense of it reaches the user's pages."""
    allowed = re.compile(r"(nox|pytest|process|the) sessions?\b|sessions? of (its|their) own|gpu-suite session|"
                         r"session's virtualenv|nox session", re.IGNORECASE)
    stray = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in _docs()
             for n, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r"\bsessions?\b", allowed.sub("", line), re.IGNORECASE)]
    assert not stray, "\n".join(stray)


def test_the_bad_input_count_the_docs_claim_is_the_tests():
    from tests.test_bad_input import CASES

    claims = [int(m) for p in _docs() for m in re.findall(r"`tests/test_bad_input\.py` refuses (\d+) bad inputs",
                                                          p.read_text())]
    assert claims == [len(CASES)], f"the docs claim {claims} bad inputs; tests/test_bad_input.py has {len(CASES)}"


def headless_table_rows(text: str) -> list[int]:
    """Line numbers of Markdown table rows that open a table without a header and delimiter row (outside code
    fences): a blank line inside a table cuts it, and the rows after it render as plain text with pipes."""
    lines, out, fenced = text.splitlines(), [], False
    for n, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if fenced or not line.startswith("|") or (n and lines[n - 1].startswith("|")):
            continue
        if not re.fullmatch(r"\|[\s:|-]+\|", lines[n + 1] if n + 1 < len(lines) else ""):
            out.append(n + 1)
    return out


def test_every_table_in_the_docs_has_its_header():
    assert {str(p.relative_to(ROOT)): headless_table_rows(p.read_text()) for p in _docs()} == \
        {str(p.relative_to(ROOT)): [] for p in _docs()}


def test_a_table_cut_by_a_blank_line_is_caught():
    table = "| a | b |\n| --- | --- |\n| 1 | 2 |\n\n| 3 | 4 |\n\n```\n| code | only |\n```\n"
    assert headless_table_rows(table) == [5]
