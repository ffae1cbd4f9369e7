"""The release this code is: one version, written once in pyproject.toml.

Read from the pyproject.toml beside the packages when there is one (a checkout, the image's
/app): an editable install's metadata keeps the version it was installed with until it is
installed again, and a previous release's tree run with the same environment (an upgrade
test, a rollback) must name its own version, not the environment's. Without the file (a
wheel), the installed package's metadata says it."""

from __future__ import annotations

import tomllib
from functools import cache
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as installed_version
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


@cache
def version() -> str:
    try:
        with PYPROJECT.open("rb") as handle:
            project = tomllib.load(handle).get("project", {})
        if project.get("name") == "batchweb" and project.get("version"):
            return str(project["version"])
    except (OSError, tomllib.TOMLDecodeError):
        pass
    try:
        return installed_version("batchweb")
    except PackageNotFoundError:
        return "unknown"
