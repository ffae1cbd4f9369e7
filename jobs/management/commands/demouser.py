"""`manage.py demouser`: the laptop's demo account, with a fresh password and API key
printed each time (`make run` calls it)."""

from __future__ import annotations

import secrets
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand

from jobs.services.keys import create_api_key


class Command(BaseCommand):
    help = "Create or reset the demo user and print its login and a new API key."
    # As Django's createsuperuser: an account command needs none of the web tier's
    # checks, and the URL check alone imports every view (~0.3 s).
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--username", default="demo")

    def handle(self, *args: Any, **options: Any) -> None:
        user, _ = get_user_model().objects.get_or_create(username=options["username"])
        password = secrets.token_urlsafe(9)
        user.set_password(password)
        user.save()
        _, key = create_api_key(owner=user, name="demo")
        self.stdout.write(f"  login:    {user.username} / {password}\n  API key:  {key}")
