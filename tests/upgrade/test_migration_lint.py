"""The migration lint of `make check` (tests/upgrade/lint_migrations.py) on a copy of this
tree: it passes as the tree is, fails on a migration planted after the last one that the
previous release's workers could not run beside (a column dropped; a NOT NULL column
without a database default), and passes the dropped column once its file names its
two-step plan. Migrations up to the previous release are its baseline."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from django.conf import settings

from tests.factories import ROOT

# Its tests run the migration linter as a process.
pytestmark = pytest.mark.processes

PLANTED = '''from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("jobs", "{leaf}")]
    operations = [{operation}]
'''
DROP = 'migrations.RemoveField(model_name="batch", name="metadata")'
NOT_NULL = ('migrations.AddField(model_name="batch", name="tier", '
            'field=models.CharField(max_length=8, default="a"), preserve_default=False)')


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    if "postgresql" not in settings.DATABASES["default"]["ENGINE"]:
        pytest.skip("the lint reads PostgreSQL's SQL: run with a PostgreSQL DATABASE_URL")
    copy = tmp_path / "tree"
    skip = shutil.ignore_patterns("__pycache__")
    for name in ("batchweb", "jobs", "engine", "tests", "deploy"):
        shutil.copytree(ROOT / name, copy / name, ignore=skip)
    for name in ("manage.py", "pyproject.toml"):
        shutil.copy(ROOT / name, copy / name)
    return copy


def lint(tree: Path) -> tuple[int, str]:
    # The copy has no .git: the baseline comes from this repository's history.
    env = {**os.environ, "GIT_DIR": str(ROOT / ".git")}
    done = subprocess.run([sys.executable, "-m", "tests.upgrade.lint_migrations",
                           "--root", str(tree)], cwd=tree, env=env, capture_output=True,
                          text=True)
    print(done.stdout + done.stderr)
    return done.returncode, done.stdout


def plant(tree: Path, name: str, operation: str) -> Path:
    folder = tree / "jobs" / "migrations"
    leaf = max(p.stem for p in folder.glob("[0-9][0-9][0-9][0-9]_*.py"))
    path = folder / f"{int(leaf[:4]) + 1:04d}_{name}.py"
    path.write_text(PLANTED.format(leaf=leaf, operation=operation))
    return path


def test_the_tree_passes_the_lint(tree: Path) -> None:
    rc, out = lint(tree)
    assert rc == 0, out
    assert "linting those added since" in out


def test_a_dropped_column_fails_until_it_names_its_plan(tree: Path) -> None:
    path = plant(tree, "drop_metadata", DROP)
    rc, out = lint(tree)
    assert rc == 1 and f"(jobs, {path.stem})... ERR" in out and "DROPPING columns" in out
    plan = ("# Two-step plan: 0.2.0 stopped reading Batch.metadata (expand); this release "
            "drops it (contract).")
    path.write_text(plan + "\n" + path.read_text())
    rc, out = lint(tree)
    assert rc == 0, out
    assert f"(jobs, {path.stem})... IGNORE (two-step plan: 0.2.0 stopped reading" in out


def test_a_not_null_column_without_a_database_default_fails(tree: Path) -> None:
    path = plant(tree, "batch_tier", NOT_NULL)
    rc, out = lint(tree)
    assert rc == 1 and f"(jobs, {path.stem})... ERR" in out and "NOT NULL" in out
