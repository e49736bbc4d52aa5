"""Candidates of a bisect and the environments they run in: releases of a distribution (listed from the
package index's JSON API, or from a local directory of wheels; each installed --no-deps into a cached
virtualenv layered over this one) or the commits of a local git checkout (a detached worktree moved from
commit to commit, put first on the path)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from harness.errors import BadInput

PYPI_JSON = "https://pypi.org/pypi/{name}/json"


# -- versions of a distribution -----------------------------------------------------------------------
def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def find_links_dirs(find_links: list[str] | None = None) -> list[Path]:
    """Local directories of distributions: `find_links`, else pip's PIP_FIND_LINKS (file:// URLs too;
    remote find-links pages are left to pip)."""
    entries = find_links if find_links is not None else os.environ.get("PIP_FIND_LINKS", "").split()
    dirs = []
    for entry in entries:
        path = Path(entry.removeprefix("file://"))
        if path.is_dir():
            dirs.append(path)
    return dirs


def local_versions(package: str, dirs: list[Path]) -> list[str]:
    """Versions of `package` among the wheels (and sdists) in these directories, from their file names."""
    from packaging.utils import (
        InvalidSdistFilename,
        InvalidWheelFilename,
        canonicalize_name,
        parse_sdist_filename,
        parse_wheel_filename,
    )

    want, found = canonicalize_name(package), set()
    for d in dirs:
        for f in d.iterdir():
            try:
                if f.name.endswith(".whl"):
                    name, version = parse_wheel_filename(f.name)[:2]
                elif f.name.endswith((".tar.gz", ".zip")):
                    name, version = parse_sdist_filename(f.name)
                else:
                    continue
            except (InvalidWheelFilename, InvalidSdistFilename):
                continue
            if name == want:
                found.add(str(version))
    return list(found)


def pypi_versions(package: str, prereleases: bool = False, timeout_s: float = 30) -> list[str]:
    """Releases of `package` on PyPI (the JSON API's `releases`): those with at least one file not yanked;
    pre-releases only when asked."""
    import json
    import urllib.error
    import urllib.request

    from packaging.version import InvalidVersion, Version

    url = PYPI_JSON.format(name=package)
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            releases = json.load(resp).get("releases", {})
    except urllib.error.HTTPError as exc:
        raise BadInput(f"cannot list {package} versions from the package index: {url}: HTTP {exc.code}"
                       + (" (no such project)" if exc.code == 404 else "")) from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise BadInput(f"cannot list {package} versions from the package index: {url}: {reason} (offline: "
                       f"PIP_FIND_LINKS=DIR PIP_NO_INDEX=1 lists the wheels in DIR)") from None
    out = []
    for text, files in releases.items():
        try:
            version = Version(text)
        except InvalidVersion:
            continue
        if (version.is_prerelease and not prereleases) or not any(not f.get("yanked") for f in files):
            continue
        out.append(text)
    return out


def index_versions(package: str, prereleases: bool = False, find_links: list[str] | None = None,
                   no_index: bool | None = None) -> list[str]:
    """Released versions of a package, oldest first: those in local wheel directories (`find_links`, else
    pip's PIP_FIND_LINKS) and, unless `no_index` (else pip's PIP_NO_INDEX), those on PyPI."""
    from packaging.version import Version

    dirs = find_links_dirs(find_links)
    found = set(local_versions(package, dirs))
    if not (no_index if no_index is not None else _env_flag("PIP_NO_INDEX")):
        found |= set(pypi_versions(package, prereleases))
    elif not found:
        raise BadInput(f"cannot list {package} versions: no index (PIP_NO_INDEX) and no {package} wheel in "
                       f"{', '.join(map(str, dirs)) or 'PIP_FIND_LINKS (unset)'}")
    return sorted((v for v in found if prereleases or not Version(v).is_prerelease), key=Version)


def version_range(spec: str):
    """(A, B) of 'A..B' as versions, oldest first; BadInput for a malformed or backwards range."""
    from packaging.version import InvalidVersion, Version

    try:
        lo, hi = (Version(x) for x in spec.split("..", 1))
    except InvalidVersion:
        raise BadInput(f"{spec!r} is not a version range (give e.g. 0.15.0..0.16.1)") from None
    if lo > hi:
        raise BadInput(f"version range {spec} runs backwards: give the older release first ({hi}..{lo}; "
                       "--find-fix searches for the first fixed one)")
    return lo, hi


def check_ranges(specs: list[str]) -> None:
    """BadInput for a malformed or backwards A..B, before the index is asked or anything is made."""
    for spec in specs:
        if ".." in spec:
            version_range(spec)


def expand_versions(specs: list[str], available: Callable[[], list[str]], prereleases: bool = False) -> list[str]:
    """'0.15.0 0.16.1' as given, or 'A..B' for every release from A to B on the index; oldest first."""
    from packaging.version import InvalidVersion, Version

    out: list[str] = []
    for spec in specs:
        if ".." in spec:
            lo, hi = version_range(spec)
            inside = [v for v in available()
                      if lo <= Version(v) <= hi and (prereleases or not Version(v).is_prerelease)]
            if not inside:
                raise BadInput(f"no released version in {spec} on the package index")
            out += sorted(inside, key=Version)
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


# -- commits of a checkout ----------------------------------------------------------------------------
def git(repo: Path, *args: str) -> str:
    """git's stdout; BadInput naming the command when it fails."""
    proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise BadInput(f"git {' '.join(args[:3])} in {repo} failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    return proc.stdout.strip()


class Worktree:
    """A detached worktree of a local checkout, moved from commit to commit; removed on close."""

    def __init__(self, repo: Path, cache: Path):
        self.repo = repo
        self.path = Path(tempfile.mkdtemp(prefix="harness-bisect-wt-", dir=cache))
        self.path.rmdir()
        git(repo, "worktree", "add", "--detach", "--quiet", str(self.path), "HEAD")

    def checkout(self, commit: str) -> Path:
        git(self.path, "checkout", "--detach", "--quiet", "--force", commit)
        return self.path

    def close(self) -> None:
        subprocess.run(["git", "-C", str(self.repo), "worktree", "remove", "--force", str(self.path)],
                       capture_output=True)
        shutil.rmtree(self.path, ignore_errors=True)


def commits_between(repo: Path, old: str, new: str) -> list[tuple[str, str]]:
    """[(sha, subject)] from old to new inclusive, oldest first (new must descend from old)."""
    old_sha, new_sha = git(repo, "rev-parse", "--verify", f"{old}^{{commit}}"), \
        git(repo, "rev-parse", "--verify", f"{new}^{{commit}}")
    if subprocess.run(["git", "-C", str(repo), "merge-base", "--is-ancestor", old_sha, new_sha]).returncode != 0:
        raise BadInput(f"{old} is not an ancestor of {new} in {repo}: the earlier commit comes first "
                       f"(--good for a regression, --bad with --find-fix)")
    lines = git(repo, "log", "--reverse", "--ancestry-path", "--format=%H %s", f"{old_sha}..{new_sha}").splitlines()
    subject = git(repo, "log", "-1", "--format=%s", old_sha)
    return [(old_sha, subject)] + [(sha, subj) for sha, _, subj in (line.partition(" ") for line in lines)]


# -- candidates ---------------------------------------------------------------------------------------
@dataclass
class Environment:
    """Where a candidate runs: an interpreter and directories put first on its path."""

    python: str
    pythonpath: list[str] = field(default_factory=list)


class PackageCandidates:
    """Releases of a distribution, oldest first; each in a cached virtualenv over this environment."""

    def __init__(self, package: str, specs: list[str], cache: Path, prereleases: bool = False):
        self.package, self.cache = package, cache
        self.versions = expand_versions(specs, lambda: index_versions(package, prereleases), prereleases)
        self.labels = list(self.versions)

    def environment(self, i: int) -> Environment:
        """RuntimeError when the release cannot be installed (the step cannot tell)."""
        return Environment(version_env(self.package, self.versions[i], self.cache))

    def close(self) -> None:
        pass


class CommitCandidates:
    """The commits of a checkout from `old` to `new`, oldest first, in one worktree moved between them."""

    def __init__(self, repo: Path, old: str, new: str, cache: Path, path_in_repo: str = "."):
        self.repo, self.path_in_repo = repo, path_in_repo
        self.commits = commits_between(repo, old, new)
        self.labels = [f"{sha[:10]} {subject[:50]}" for sha, subject in self.commits]
        self.worktree = Worktree(repo, cache)

    def environment(self, i: int) -> Environment:
        path = self.worktree.checkout(self.commits[i][0])
        return Environment(sys.executable, [str(path / self.path_in_repo)])

    def index_of(self, sha: str) -> int | None:
        return next((i for i, (s, _) in enumerate(self.commits) if s == sha), None)

    def close(self) -> None:
        self.worktree.close()
