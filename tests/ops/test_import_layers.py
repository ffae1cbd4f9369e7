"""The layer rules of docs/architecture.md hold (`.importlinter`, run by `make lint`), and an
import that breaks one fails: each planted in a copy of the source tree."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# Its tests run lint-imports as a process.
pytestmark = pytest.mark.processes

ROOT = Path(__file__).resolve().parents[2]

LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
PACKAGES = ("batchweb", "jobs", "engine")


def lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    """import-linter with the checkout's contracts, on the packages found first in `tree`."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--config", str(ROOT / ".importlinter")],
        cwd=tree, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """The source packages' Python files copied to a directory of their own."""
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package,
                        ignore=shutil.ignore_patterns("__pycache__", "migrations", "*.json",
                                                      "*.sh", "*.html", "*.js", "*.css"))
    return tmp_path


def test_the_checkout_keeps_every_contract() -> None:
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert " 0 broken" in result.stdout


# (where the import is planted, the import, the contract whose name the failure names)
VIOLATIONS = [
    ("jobs/storage/planted.py", "from jobs.services import batches",
     "jobs: each layer imports only the layers below it"),
    ("jobs/formats/planted.py", "def later():\n    from jobs.queries import dashboard",
     "jobs: each layer imports only the layers below it"),
    ("jobs/views/planted.py", "from jobs.api import base",
     "jobs: the API, the dashboard, the admin and the worker never import each other"),
    ("jobs/queries/planted.py", "from jobs.services import batches",
     "jobs: services and queries never import each other"),
    ("engine/planted.py", "from django.conf import settings",
     "engine: imports no Django"),
    ("engine/planted.py", "from jobs import models",
     "engine: imports neither jobs nor batchweb"),
    ("engine/endpoints/planted.py", "from engine import base",
     "engine.endpoints: imports neither Django, jobs, batchweb nor the rest of engine"),
    ("batchweb/planted.py", "import torch",
     "only engine imports vLLM, torch and transformers"),
    ("jobs/services/planted.py", "import boto3",
     "jobs: only jobs.storage speaks S3 (boto3, botocore, django-storages)"),
    ("jobs/lib/planted.py", "from batchweb import urls",
     "jobs and engine never import batchweb's urls, wsgi or settings"),
]


@pytest.mark.parametrize(("path", "code", "contract"), VIOLATIONS,
                         ids=[f"{path}:{code.split()[-1]}" for path, code, _ in VIOLATIONS])
def test_a_planted_import_breaks_its_contract(
        tree: Path, path: str, code: str, contract: str) -> None:
    (tree / path).write_text(f"{code}\n")
    result = lint_imports(tree)
    assert result.returncode != 0, result.stdout
    assert f"{contract} BROKEN" in result.stdout, result.stdout
    assert "planted" in result.stdout


def test_one_engine_importing_another_breaks_their_independence(tree: Path) -> None:
    remote = tree / "engine" / "remote.py"
    remote.write_text(remote.read_text() + "\nfrom engine import echo  # noqa\n")
    result = lint_imports(tree)
    assert result.returncode != 0
    assert ("engine: the vLLM, remote and echo engines never import each other BROKEN"
            in result.stdout), result.stdout


def test_settings_importing_the_app_breaks_their_rule(tree: Path) -> None:
    settings = tree / "batchweb" / "settings.py"
    settings.write_text(settings.read_text() + "\nfrom jobs.lib import errors  # noqa\n")
    result = lint_imports(tree)
    assert result.returncode != 0
    assert "batchweb.settings: imports nothing of jobs or engine BROKEN" in result.stdout
