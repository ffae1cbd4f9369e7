"""The Django admin: every model's pages render, keys are created hashed, actions work."""

from __future__ import annotations

import re

import pytest
from django.contrib.admin.utils import quote  # ids in admin URLs are quoted

from jobs.models import ApiKey, Batch, Shard
from jobs.services.batches import create_batch
from jobs.services.files import create_input_file
from jobs.services.validation import run_validation
from tests.factories import chat_line, jsonl

pytestmark = pytest.mark.django_db


@pytest.fixture
def staff(admin_client):
    return admin_client


@pytest.fixture
def running_batch(user, tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl([chat_line(f"r{i}", "x") for i in range(3)]))
    file = create_input_file(owner=user, path=path, filename="in.jsonl", purpose="batch")
    batch = create_batch(owner=user, input_file_id=file.pk, endpoint="/v1/chat/completions",
                         completion_window="24h")
    run_validation(batch_id=batch.pk)
    return Batch.objects.get(pk=batch.pk)


def test_every_admin_page_renders(staff, running_batch):
    shard = Shard.objects.filter(batch=running_batch).first()
    for url in ["/admin/jobs/batch/", f"/admin/jobs/batch/{quote(running_batch.pk)}/change/",
                "/admin/jobs/shard/", f"/admin/jobs/shard/{quote(shard.pk)}/change/",
                "/admin/jobs/file/",
                f"/admin/jobs/file/{quote(running_batch.input_file_id)}/change/",
                "/admin/jobs/upload/", "/admin/jobs/apikey/", "/admin/jobs/apikey/add/"]:
        assert staff.get(url).status_code == 200, url


def test_plain_users_cannot_open_the_admin(client, user):
    client.force_login(user)
    response = client.get("/admin/jobs/batch/")
    assert response.status_code == 302
    assert "/admin/login/" in response["Location"]


def test_admin_creates_a_hashed_key_shown_once(staff, user):
    response = staff.post("/admin/jobs/apikey/add/", {"owner": user.pk, "name": "ops"})
    assert response.status_code == 200
    key = ApiKey.objects.get(name="ops")
    # On the response itself, never cached, and in no message that a later page shows.
    shown = set(re.findall(r"sk-bw-[A-Za-z0-9_\-]{20,}", response.content.decode()))
    assert len(shown) == 1
    assert "no-store" in response["Cache-Control"]
    assert not list(response.context["messages"])
    secret = shown.pop()
    assert secret not in staff.get("/admin/jobs/apikey/").content.decode()
    assert key.secret_hash != secret and secret not in key.secret_hash
    from jobs.services.keys import authenticate_key

    assert authenticate_key(secret).pk == key.pk


def test_revoke_action(staff, user):
    from jobs.services.keys import create_api_key

    key, secret = create_api_key(owner=user, name="x")
    staff.post("/admin/jobs/apikey/", {"action": "revoke", "_selected_action": [key.pk]})
    key.refresh_from_db()
    assert key.revoked_at is not None


def test_cancel_and_requeue_actions(staff, running_batch):
    Shard.objects.filter(batch=running_batch).update(enqueued_at=None)
    staff.post("/admin/jobs/batch/", {"action": "requeue_shards",
                                      "_selected_action": [running_batch.pk]})
    assert Shard.objects.filter(batch=running_batch, enqueued_at__isnull=False).exists()
    staff.post("/admin/jobs/batch/", {"action": "cancel", "_selected_action": [running_batch.pk]})
    running_batch.refresh_from_db()
    assert running_batch.status == "cancelling"
    assert set(Shard.objects.filter(batch=running_batch).values_list("status", flat=True)) == {
        "abandoned"}
