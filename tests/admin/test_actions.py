"""The admin's actions and forms: keys created hashed and revoked, batches cancelled and
their shards requeued, expired files deleted, webhooks retried, quotas and content rules
edited."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.core.files.storage import default_storage
from django.utils import timezone

from jobs.lib import queues
from jobs.models import ApiKey, ContentRule, File, Quota, Shard, WebhookEvent
from tests.factories import chat_lines, make_batch, make_file

pytestmark = pytest.mark.django_db


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


@pytest.mark.django_db
def test_admin_edits_the_default_and_user_quotas(admin_client, user):
    from jobs.services.quotas import limits_for

    admin_client.get("/admin/jobs/quota/")
    default = Quota.objects.get(user__isnull=True)
    response = admin_client.post(f"/admin/jobs/quota/{default.pk}/change/",
                                 {"tokens_per_day": "5000"})
    assert response.status_code == 302
    response = admin_client.post("/admin/jobs/quota/add/", {"user": user.pk,
                                                            "max_active_batches": "3"})
    assert response.status_code == 302
    assert limits_for(user)["tokens_per_day"] == 5000
    assert limits_for(user)["max_active_batches"] == 3
    # A second row for the same user is refused by the form.
    response = admin_client.post("/admin/jobs/quota/add/", {"user": user.pk})
    assert response.status_code == 200 and Quota.objects.filter(user=user).count() == 1


@pytest.mark.django_db(transaction=True)
def test_delete_expired_files_action(admin_client, user, tmp_path):
    expired = make_file(user, chat_lines(1), tmp_path)
    fresh = make_file(user, chat_lines(1), tmp_path)
    running = make_batch(user, chat_lines(1), tmp_path)
    File.objects.filter(pk__in=[expired.pk, running.input_file_id]).update(
        expires_at=timezone.now() - timedelta(days=1))
    response = admin_client.post("/admin/jobs/file/", {
        "action": "delete_expired",
        "_selected_action": [expired.pk, fresh.pk, running.input_file_id]}, follow=True)
    shown = [str(m) for m in response.context["messages"]]
    assert any("Deleted 1 expired file(s)" in m for m in shown)
    assert any("an active batch still reads" in m and running.input_file_id in m
               for m in shown)
    assert any("Kept 1 file(s) that have not expired" in m for m in shown)
    assert not File.objects.filter(pk=expired.pk).exists()
    assert not default_storage.exists(expired.storage_name)
    assert File.objects.filter(pk__in=[fresh.pk, running.input_file_id]).count() == 2


@pytest.mark.django_db
def test_requeue_action_retries_stuck_and_failed_shards(admin_client, user, tmp_path,
                                                        settings):
    batch = make_batch(user, chat_lines(6), tmp_path, shard_size=2, settings=settings)
    stuck, failed, waiting = Shard.objects.filter(batch=batch).order_by("index")
    long_ago = timezone.now() - timedelta(hours=1)
    Shard.objects.filter(pk=stuck.pk).update(status=Shard.Status.RUNNING, attempt=1,
                                             worker="gone", heartbeat_at=long_ago,
                                             started_at=long_ago)
    Shard.objects.filter(pk=failed.pk).update(status=Shard.Status.ABANDONED, failures=4,
                                              end_code="shard_failed", failed=2,
                                              finished_at=long_ago)
    Shard.objects.filter(pk=waiting.pk).update(
        not_before=timezone.now() + timedelta(hours=1), enqueued_at=None)
    page = admin_client.get("/admin/jobs/shard/health/").content.decode()
    assert "stuck" in page and batch.pk in page

    response = admin_client.post("/admin/jobs/batch/", {
        "action": "requeue_shards", "_selected_action": [batch.pk]}, follow=True)
    assert any("Requeued 3 shard(s)" in str(m) for m in response.context["messages"])
    rows = {s.pk: s for s in Shard.objects.filter(batch=batch)}
    assert rows[stuck.pk].status == "queued" and rows[stuck.pk].failures == 1
    assert "requeued by an operator" in rows[stuck.pk].last_error
    assert rows[failed.pk].status == "queued" and rows[failed.pk].failures == 0
    assert rows[failed.pk].end_code == "" and rows[failed.pk].failed == 0
    assert rows[waiting.pk].not_before is None
    # Jobs were created (fair share: two of the batch's shards at a time).
    assert sum(1 for s in rows.values() if s.enqueued_at) == 2
    assert len(queues.queue("echo-test.default").job_ids) == 2


@pytest.mark.django_db(transaction=True)
def test_webhook_retry_action(admin_client, user, tmp_path):
    event = WebhookEvent.objects.create(owner=user, type="batch.completed", batch_id="batch_x",
                                        status=WebhookEvent.Status.FAILED, attempts=8)
    delivered = WebhookEvent.objects.create(owner=user, type="batch.failed",
                                            batch_id="batch_y",
                                            status=WebhookEvent.Status.DELIVERED)
    admin_client.post("/admin/jobs/webhookevent/", {
        "action": "retry", "_selected_action": [event.pk, delivered.pk]})
    event.refresh_from_db()
    assert event.status == "pending" and event.next_attempt_at <= timezone.now()
    assert WebhookEvent.objects.get(pk=delivered.pk).status == "delivered"
    assert queues.queue(queues.WEBHOOK_QUEUE).job_ids == [f"{event.pk}-webhook"]


@pytest.mark.django_db
def test_admin_form_refuses_an_invalid_regex_with_the_reason(admin_client):
    form = {"name": "keys", "kind": "regex", "pattern": r"key=(?!test)\w+", "action": "reject",
            "reason": "", "max_tokens": "", "model": "", "threshold": "", "enabled": "on"}
    response = admin_client.post("/admin/jobs/contentrule/add/", form)
    assert response.status_code == 200
    assert "lookarounds" in response.content.decode()
    assert not ContentRule.objects.exists()
    response = admin_client.post("/admin/jobs/contentrule/add/",
                                 {**form, "pattern": r"key=\w+"})
    assert response.status_code == 302
    assert ContentRule.objects.get().pattern == r"key=\w+"
