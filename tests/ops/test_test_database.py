"""The suite's own database plumbing (tests/conftest.py): what a live-database test leaves
for the next one."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Permission
from django.contrib.contenttypes.models import ContentType
from django.core.management import call_command

from jobs.models import Batch


@pytest.mark.django_db(transaction=True)
def test_a_flush_puts_back_the_content_types_and_permissions_migrate_made() -> None:
    def rows() -> tuple[list, list]:
        return (sorted(ContentType.objects.values_list("app_label", "model")),
                sorted(Permission.objects.values_list("content_type__app_label",
                                                      "content_type__model", "codename")))

    before = rows()
    assert ("jobs", "batch") in before[0]
    assert ("jobs", "batch", "change_batch") in before[1]

    call_command("flush", verbosity=0, interactive=False)  # as a live-database test ends

    assert rows() == before
    # The content type cache still names rows that exist.
    assert ContentType.objects.get_for_model(Batch).id == ContentType.objects.get(
        app_label="jobs", model="batch").id
