"""The previous release, taken from this repository's own history: the commit that
deploy/previous-release records, its tree written out with `git archive` (no network, no
tag needed: a fresh clone has the commit). It runs with this checkout's environment, which
holds when its dependencies are those of this release (checked: its pyproject.toml's)."""

from __future__ import annotations

import io
import subprocess
import tarfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.factories import ROOT

RECORD = ROOT / "deploy" / "previous-release"


@dataclass(frozen=True)
class Release:
    version: str
    commit: str


def previous_release() -> Release:
    lines = [line.split() for line in RECORD.read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert len(lines) == 1 and len(lines[0]) == 2, f"{RECORD}: one line, VERSION COMMIT"
    return Release(version=lines[0][0], commit=lines[0][1])


def pyproject_of(commit: str) -> dict:
    shown = subprocess.run(["git", "show", f"{commit}:pyproject.toml"], cwd=ROOT,
                           capture_output=True, check=True)
    return tomllib.loads(shown.stdout.decode())


def write_tree(release: Release, dest: Path) -> Path:
    """The release's files under `dest`, as `git archive` gives them."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the previous release comes from its history")
    found = subprocess.run(["git", "cat-file", "-e", f"{release.commit}^{{commit}}"], cwd=ROOT)
    assert found.returncode == 0, (f"commit {release.commit} ({RECORD.name}) is not in this "
                                   "clone's history (a shallow clone? fetch it whole)")
    archive = subprocess.run(["git", "archive", "--format=tar", release.commit], cwd=ROOT,
                             capture_output=True, check=True).stdout
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    return dest
