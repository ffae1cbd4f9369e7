"""`make check`'s migration lint: django-migration-linter on every migration added since the
previous release (deploy/previous-release; the ones it shipped are the baseline, run
everywhere already). A migration the previous release's workers could not run beside (a
column dropped or renamed, a NOT NULL column without a database default, a table renamed
or dropped) fails it, unless its file carries its two-step plan, a comment
`# Two-step plan: ...` naming the release that expanded and what this one contracts
(docs/upgrading.md): the linter then ignores it (its ignore_name). A comment, not the
linter's IgnoreMigration() operation, because migrations run in production, where the
linter (a test dependency) is not installed.

The SQL linted is PostgreSQL's (DATABASE_URL; CI has one): a rolling update, old workers
beside a migrated schema, happens on the deployments with PostgreSQL (compose,
Kubernetes). The embedded SQLite service stops and starts as one, and SQLite's SQL for
most changes is a table rebuilt, which the linter cannot tell safe from unsafe: without
PostgreSQL the lint says so and passes.

    python -m tests.upgrade.lint_migrations [--root TREE]
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

PLAN = re.compile(r"^\s*#\s*two-step plan:\s*(\S.*)$", re.IGNORECASE | re.MULTILINE)


def baseline(root: Path, commit: str) -> set[str]:
    """The migrations the previous release shipped (from the repository's history)."""
    listed = subprocess.run(["git", "ls-tree", "--name-only", f"{commit}:jobs/migrations"],
                            cwd=root, capture_output=True, text=True)
    if listed.returncode != 0:
        sys.exit(f"migrations: the previous release's commit {commit} (deploy/previous-release)"
                 f" is not in this clone's history; fetch it whole ({listed.stderr.strip()})")
    return {name.removesuffix(".py") for name in listed.stdout.split()
            if name.endswith(".py") and name != "__init__.py"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[2],
                        help="the tree whose migrations are linted (default: this one)")
    root = parser.parse_args().root.resolve()
    sys.path.insert(0, str(root))
    os.chdir(root)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    from django.conf import settings

    database = settings.DATABASES["default"]
    if "postgresql" not in database["ENGINE"]:
        print("migrations: not linted (no PostgreSQL in DATABASE_URL; see "
              "tests/upgrade/lint_migrations.py)")
        return 0
    # Only the SQL is read, never a table: the server's maintenance database (CI's
    # DATABASE_URL names one the tests create).
    database["NAME"] = "postgres"
    import django

    django.setup()
    logging.getLogger("django_migration_linter").setLevel(logging.WARNING)
    from django.db.migrations.loader import MigrationLoader
    from django_migration_linter import MigrationLinter

    from tests.upgrade.releases import previous_release

    previous = previous_release()
    old = baseline(root, previous.commit)
    planned = {}
    for (app, name), migration in MigrationLoader(None).disk_migrations.items():
        source = Path(sys.modules[migration.__module__].__file__ or "").read_text()
        if app == "jobs" and name not in old and (plan := PLAN.search(source)):
            planned[name] = plan.group(1).strip()
    print(f"migrations: linting those added since {previous.version} ({len(old)} baseline)")
    for name, plan in sorted(planned.items()):
        print(f"(jobs, {name})... IGNORE (two-step plan: {plan})")
    linter = MigrationLinter(str(root), include_apps=["jobs"],
                             ignore_name=sorted(old | set(planned)), no_cache=True,
                             quiet=["ignore"])
    linter.lint_all_migrations(app_label="jobs")
    linter.print_summary()
    return 1 if linter.has_errors else 0


if __name__ == "__main__":
    sys.exit(main())
