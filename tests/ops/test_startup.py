"""What a process loads when Django starts: a worker skips what only pages or rare requests
use, and the admin's checks still see every ModelAdmin."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from django.contrib import admin
from django.core import checks

from jobs.models import Batch
from tests.factories import ROOT


@pytest.mark.processes
def test_a_worker_starts_without_the_admin_jsonschema_or_numpy() -> None:
    code = ("import json, sys, django; django.setup(); "
            "import jobs.management.commands.batchworker; "
            "print(json.dumps({m: m in sys.modules for m in "
            "('jobs.admin', 'django_rq.admin', 'jsonschema', 'numpy')}))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, check=True,
                          env={**os.environ, "DJANGO_SETTINGS_MODULE": "batchweb.settings"})
    assert json.loads(done.stdout.splitlines()[-1]) == dict.fromkeys(
        ("jobs.admin", "django_rq.admin", "jsonschema", "numpy"), False)


def test_the_admin_checks_see_every_model_admin(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not checks.run_checks(tags=[checks.Tags.admin])
    monkeypatch.setattr(admin.site._registry[Batch], "list_display", ("no_such_field",))
    found = checks.run_checks(tags=[checks.Tags.admin])
    assert [error.id for error in found] == ["admin.E108"]
