"""Comments and docstrings cite files that exist in this repository (not design notes elsewhere)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# a repository path: a top-level folder of ours followed by a file name with an extension
CITED = re.compile(r"\b((?:docs|harness|tests|suites|baselines)/[\w./-]*\.(?:md|py|json|toml))\b")


def _sources() -> list[Path]:
    return [p for d in ("harness", "tests", "suites") for p in (ROOT / d).rglob("*.py")] + [ROOT / "noxfile.py"]


def test_cited_repository_files_exist():
    missing = []
    for path in _sources():
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for cited in CITED.findall(line):
                if "<" in cited or "*" in cited:
                    continue  # a pattern, e.g. baselines/<platform>/<suite>.json
                if not (ROOT / cited).exists():
                    missing.append(f"{path.relative_to(ROOT)}:{n}: {cited}")
    assert not missing, "\n".join(missing)


def test_no_citation_leaves_the_repository():
    outside = [f"{p.relative_to(ROOT)}:{n}" for p in _sources()
               for n, line in enumerate(p.read_text().splitlines(), 1) if "../shared/" in line and p.name != "test_docs.py"]
    assert not outside, outside
