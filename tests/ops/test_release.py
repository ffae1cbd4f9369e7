"""One version, in pyproject.toml, read in one place (jobs.lib.release) and shown where an
operator looks: the dashboard's footer, `manage.py batchwebversion`, each engine's
provenance; the CHANGELOG starts with it, and the previous release is a commit of this
repository's history with a lower version."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib

import pytest
from django.urls import reverse
from packaging.version import Version

from jobs.lib import release
from tests.factories import ROOT
from tests.upgrade.releases import previous_release, pyproject_of


def pyproject_version() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_the_version_is_pyprojects() -> None:
    assert release.version() == pyproject_version()


@pytest.mark.processes
def test_manage_py_batchwebversion_prints_it() -> None:
    done = subprocess.run([sys.executable, "manage.py", "batchwebversion"], cwd=ROOT,
                          text=True, capture_output=True, check=True, env=os.environ.copy())
    assert done.stdout.strip() == pyproject_version()


def test_the_worker_records_it_beside_the_engines_record(tmp_path) -> None:
    """The engine's record says what ran the model; the worker adds the release that ran
    the engine (the engine knows nothing of batchweb)."""
    from engine.base import ModelSpec
    from engine.echo import EchoEngine
    from jobs.worker.served import Served

    engine = EchoEngine(ModelSpec(name="echo-test", backend="echo"))
    assert "batchweb_version" not in engine.provenance()
    served = Served(engine=engine, store=None, adapters=None)  # type: ignore[arg-type]
    assert served.record()["batchweb_version"] == pyproject_version()


def test_the_footer_shows_it_to_a_signed_in_user_only(site) -> None:
    page = site.get(reverse("batch_list")).content.decode()
    assert f'<footer class="muted small" id="release">batchweb {pyproject_version()}' in page
    site.logout()
    login = site.get(reverse("login"))
    assert login.status_code == 200 and 'id="release"' not in login.content.decode()


def test_the_changelog_starts_with_this_release() -> None:
    first = re.search(r"^## (\S+)", (ROOT / "CHANGELOG.md").read_text(), re.MULTILINE)
    assert first and first.group(1) == pyproject_version()


@pytest.mark.processes
def test_the_previous_release_is_older_and_in_history() -> None:
    previous = previous_release()
    assert pyproject_of(previous.commit)["project"]["version"] == previous.version
    assert Version(previous.version) < Version(pyproject_version())
