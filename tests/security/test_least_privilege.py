"""Least privilege in the admin: actions need more than view permission, API keys for
others only from superusers (shown once, never cached), django-rq for superusers only."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import Permission
from django.test import Client

from jobs.models import ApiKey, Batch
from jobs.services.keys import create_api_key
from tests.factories import chat_line, make_batch

pytestmark = pytest.mark.django_db

ACTIONS = {"/admin/jobs/batch/": ["cancel", "requeue_shards"],
           "/admin/jobs/apikey/": ["revoke"], "/admin/jobs/file/": ["delete_expired"],
           "/admin/jobs/webhookevent/": ["retry"]}


def _staff(django_user_model: Any, name: str, *codenames: str) -> Client:
    user = django_user_model.objects.create_user(name, password="pw", is_staff=True)
    user.user_permissions.set(Permission.objects.filter(content_type__app_label="jobs",
                                                        codename__in=codenames))
    client = Client()
    client.force_login(user)
    return client


def _offered(client: Client, url: str) -> set[str]:
    form = client.get(url).context["action_form"]
    return set() if form is None else {name for name, _ in form.fields["action"].choices}


def test_a_view_only_staff_user_is_offered_no_action_and_cannot_post_one(
        django_user_model: Any, admin_client: Any, tmp_path: Path) -> None:
    viewer = _staff(django_user_model, "viewer", "view_batch", "view_apikey", "view_file",
                    "view_webhookevent")
    for url, actions in ACTIONS.items():
        assert viewer.get(url).status_code == 200, url
        assert not _offered(viewer, url) & set(actions), url
        assert set(actions) <= _offered(admin_client, url), url  # the actions exist
    owner = django_user_model.objects.create_user("owner", password="pw")
    batch = make_batch(owner, [chat_line("a", "x")], tmp_path)
    key = create_api_key(owner=owner, name="k")[0]
    viewer.post("/admin/jobs/batch/", {"action": "cancel", "_selected_action": [batch.pk]})
    viewer.post("/admin/jobs/apikey/", {"action": "revoke", "_selected_action": [key.pk]})
    assert Batch.objects.get(pk=batch.pk).status == Batch.Status.IN_PROGRESS
    key.refresh_from_db()
    assert key.revoked_at is None
    # With the change permission the same staff user may cancel.
    editor = _staff(django_user_model, "editor", "view_batch", "change_batch")
    assert "cancel" in _offered(editor, "/admin/jobs/batch/")
    editor.post("/admin/jobs/batch/", {"action": "cancel", "_selected_action": [batch.pk]})
    assert Batch.objects.get(pk=batch.pk).status == Batch.Status.CANCELLING


def test_only_a_superuser_creates_a_key_for_somebody_else(django_user_model: Any,
                                                         admin_client: Any) -> None:
    other = django_user_model.objects.create_user("other", password="pw")
    staff = _staff(django_user_model, "keeper", "add_apikey", "view_apikey", "change_apikey")
    keeper = django_user_model.objects.get(username="keeper")
    form = staff.get("/admin/jobs/apikey/add/").context["adminform"].form
    assert list(form.fields["owner"].queryset) == [keeper]
    response = staff.post("/admin/jobs/apikey/add/", {"owner": other.pk, "name": "theirs"})
    assert response.status_code == 200 and "sk-bw-" not in response.content.decode()
    assert not ApiKey.objects.filter(owner=other).exists()
    response = staff.post("/admin/jobs/apikey/add/", {"owner": keeper.pk, "name": "mine"})
    assert ApiKey.objects.filter(owner=keeper, name="mine").exists()
    assert re.search(r"sk-bw-\S{20,}", response.content.decode())
    response = admin_client.post("/admin/jobs/apikey/add/", {"owner": other.pk, "name": "ops"})
    assert ApiKey.objects.filter(owner=other, name="ops").exists()
    assert "no-store" in response["Cache-Control"]


RQ_PAGES = ["/admin/rq/", "/admin/rq/queues/0/", "/admin/rq/queues/0/failed/",
            "/admin/rq/workers/0/", "/admin/rq/queues/0/details/"]


def test_the_rq_dashboard_is_for_superusers_only(django_user_model: Any,
                                                  admin_client: Any) -> None:
    every_permission = Permission.objects.values_list("codename", flat=True)
    staff = _staff(django_user_model, "ops", *every_permission)
    for url in RQ_PAGES:
        response = staff.get(url)
        assert response.status_code == 302 and "/admin/login/" in response["Location"], url
        assert admin_client.get(url).status_code == 200, url
    response = staff.post("/admin/rq/queues/0/empty/", {"post": "yes"})
    assert response.status_code == 302 and "/admin/login/" in response["Location"]
    # django-rq's own admin entry, which admits any staff user, is not there.
    assert staff.get("/admin/django_rq/dashboard/").status_code == 404
    assert "/admin/rq/" not in staff.get("/admin/").content.decode()
    assert "/admin/rq/" in admin_client.get("/admin/").content.decode()
