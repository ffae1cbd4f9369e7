"""The previous release's tree, written once per session from this repository's history
(tests/upgrade/releases.py), and run with this environment when it satisfies that
release's own dependencies."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as installed_version
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement

from tests.upgrade.releases import Release, previous_release, pyproject_of, write_tree


def unmet(requirements: list[str]) -> list[str]:
    """Those of `requirements` this environment does not satisfy."""
    missing = []
    for text in requirements:
        requirement = Requirement(text)
        if requirement.marker and not requirement.marker.evaluate():
            continue
        try:
            found = installed_version(requirement.name)
        except PackageNotFoundError:
            missing.append(text)
            continue
        if not requirement.specifier.contains(found, prereleases=True):
            missing.append(f"{text} (installed: {found})")
    return missing


@pytest.fixture(scope="session")
def previous(tmp_path_factory: Any) -> tuple[Release, Path]:
    release = previous_release()
    project = pyproject_of(release.commit)["project"]
    missing = unmet(project["dependencies"] + project["optional-dependencies"]["test"])
    if missing:
        pytest.skip(f"this environment lacks {release.version}'s dependencies {missing}: "
                    "its tree cannot run here")
    return release, write_tree(release, tmp_path_factory.mktemp("previous") / "tree")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The upgrade and restore figures (requests lost, duplicated, charged twice, clients
    failed) at the end of the run, passed tests' included."""
    from tests.upgrade.stack import FIGURES

    if FIGURES:
        terminalreporter.section("upgrade and restore figures")
        for line in FIGURES:
            terminalreporter.write_line(line)
