"""`manage.py batchwebversion`: the release this code is (pyproject.toml's version), as the
dashboard's footer and each engine's provenance show it; what an operator compares across
the web and worker processes during a rolling update (docs/upgrading.md). Not `version`:
Django's `manage.py version` prints Django's own."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from jobs.lib import release


class Command(BaseCommand):
    help = "Print the batchweb release of this code."
    requires_system_checks: list[str] = []

    def handle(self, *args: Any, **options: Any) -> None:
        self.stdout.write(release.version())
