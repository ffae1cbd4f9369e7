"""The migrations and the models agree: a model changed without its migration fails here,
not in a deployment, whose `migrate` would leave out what the code reads."""

from __future__ import annotations

import io

import pytest
from django.core.management import call_command


@pytest.mark.django_db  # makemigrations reads which migrations the database has
def test_every_model_change_has_its_migration(settings) -> None:
    settings.MIGRATION_MODULES = {}  # pytest's `--no-migrations` would hide them
    out = io.StringIO()
    try:
        call_command("makemigrations", check=True, dry_run=True, stdout=out)
    except SystemExit as exit_:  # --check exits 1 when a migration is missing
        raise AssertionError(f"a migration is missing:\n{out.getvalue()}") from exit_
