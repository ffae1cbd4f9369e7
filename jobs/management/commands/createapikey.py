"""`manage.py createapikey USER [--name NAME]`: print a new API key (shown only once)."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from jobs.services.keys import create_api_key


class Command(BaseCommand):
    help = "Create an API key for a user and print it. The key cannot be shown again."
    # As Django's createsuperuser: an account command needs none of the web tier's
    # checks, and the URL check alone imports every view (~0.3 s).
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("username")
        parser.add_argument("--name", default="cli")

    def handle(self, *args: Any, **options: Any) -> None:
        user = get_user_model().objects.filter(username=options["username"]).first()
        if user is None:
            raise CommandError(f"No user {options['username']!r}.")
        _, secret = create_api_key(owner=user, name=options["name"])
        self.stdout.write(secret)
