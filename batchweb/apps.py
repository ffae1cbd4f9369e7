"""The Django admin, its apps' admin modules loaded only where they are used."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.contrib.admin.apps import SimpleAdminConfig
from django.contrib.admin.checks import check_admin_app, check_dependencies
from django.core import checks


def check_admin_modules(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """The admin's own checks of every registered ModelAdmin, once the apps' admin modules
    are loaded (checks run in no set order, so this does not wait for the URLconf's)."""
    admin.autodiscover()
    return check_admin_app(app_configs, **kwargs)


class AdminConfig(SimpleAdminConfig):
    """The admin without autodiscovery when Django starts: batchweb/urls.py loads the
    apps' admin modules, so processes that serve no pages (workers, the scheduler,
    migrate) skip them, ~0.1 s of each start (the test tiers start workers by the dozen).
    The same checks as Django's admin, run after the modules are loaded."""

    def ready(self) -> None:
        checks.register(check_dependencies, checks.Tags.admin)
        checks.register(check_admin_modules, checks.Tags.admin)
