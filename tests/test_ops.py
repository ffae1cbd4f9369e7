"""Operations: the admin's new pages and actions, the queue-health page with a live worker,
the /metrics endpoint (access and content), and the reconciler's periodic share."""

from __future__ import annotations

import io
from datetime import timedelta

import pytest
from django.contrib.admin.utils import quote  # ids in admin URLs are quoted
from django.core.files.storage import default_storage
from django.urls import reverse
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from jobs import queues
from jobs.models import Batch, File, Quota, Shard, UserSettings, WebhookDelivery, WebhookEvent
from jobs.queries import health
from jobs.services.health import periodic_operations
from tests.dashboard_support import make_batch, make_file, run_batch
from tests.helpers import chat_line, jsonl, wait_for


def lines(n: int) -> list[dict]:
    return [chat_line(f"r{i}", f"q {i}") for i in range(n)]


def metrics(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of a Prometheus text page."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


# --- admin pages and actions ---


@pytest.mark.django_db
def test_new_admin_pages_render(admin_client, user, tmp_path):
    batch = run_batch(make_batch(user, lines(1), tmp_path))
    event = WebhookEvent.objects.create(owner=user, type="batch.completed", batch_id=batch.pk)
    WebhookDelivery.objects.create(event=event, attempt=1, url="http://x/", status_code=500,
                                   error="HTTP 500")
    UserSettings.objects.create(user=user, webhook_url="https://example.com/hook")
    quota = Quota.objects.create(user=user, max_active_batches=2)
    for url in ["/admin/", "/admin/jobs/quota/", "/admin/jobs/quota/add/",
                f"/admin/jobs/quota/{quota.pk}/change/", "/admin/jobs/usersettings/",
                "/admin/jobs/webhookevent/", f"/admin/jobs/webhookevent/{quote(event.pk)}/change/",
                "/admin/jobs/webhookdelivery/", "/admin/jobs/shard/health/",
                "/admin/jobs/shard/"]:
        response = admin_client.get(url)
        assert response.status_code == 200, url
    # The changelist creates the site default row for the operator to edit.
    assert Quota.objects.filter(user__isnull=True).exists()
    default = Quota.objects.get(user__isnull=True)
    assert admin_client.get(f"/admin/jobs/quota/{default.pk}/delete/").status_code == 403
    index = admin_client.get("/admin/").content.decode()
    assert reverse("admin:jobs_queue_health") in index and "/admin/rq/" in index
    # The signing secret is the user's; the admin page does not show it.
    settings_row = UserSettings.objects.get(user=user)
    page = admin_client.get(f"/admin/jobs/usersettings/{settings_row.pk}/change/")
    assert settings_row.webhook_secret not in page.content.decode()


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
    expired = make_file(user, lines(1), tmp_path)
    fresh = make_file(user, lines(1), tmp_path)
    running = make_batch(user, lines(1), tmp_path)
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
    batch = make_batch(user, lines(6), tmp_path, shard_size=2, settings=settings)
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


# --- queue health ---


@pytest.mark.django_db(transaction=True)
def test_queue_health_page_with_a_live_worker(admin_client, openai_client, workers):
    from rq import Worker

    # Slow enough that the batch is still running while we look: 6 shards of 100 requests
    # at ~40 requests/s, the worker holding one or two at a time (its inbox is bounded).
    workers.start(env={"BATCHWEB_ECHO_SECONDS": "0.05", "BATCHWEB_ECHO_MAX_IN_FLIGHT": "2",
                       "BATCHWEB_SHARD_SIZE": "100"})
    wait_for(lambda: Worker.count(connection=queues.connection()) == 1, timeout=60,
             message="the worker to register")
    file_id = openai_client.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines(600)))),
                                         purpose="batch").id
    batch = openai_client.batches.create(input_file_id=file_id,
                                         endpoint="/v1/chat/completions",
                                         completion_window="24h")

    def busy():
        snapshot = health.queue_health()
        echo = next(m for m in snapshot.models if m.model == "echo-test")
        # A shard running, the batch's next one waiting in Redis, the rest in the database.
        ready = echo.running and echo.depth["default"] >= 1 and echo.waiting_in_db >= 1
        return ready and (snapshot, echo)

    snapshot, echo = wait_for(busy, timeout=60, every=0.1, message="a busy queue")
    assert len(echo.workers) == 1 and snapshot.control_workers == 1
    assert not echo.stuck
    assert echo.running[0].batch_id == batch.id and echo.running[0].worker

    page = admin_client.get("/admin/jobs/shard/health/").content.decode()
    section = page.split('id="model-echo-test"')[1].split('class="module"')[0]
    assert '<td class="workers-alive">1</td>' in section
    assert echo.workers[0].name in section
    assert '<td class="stuck-count">0</td>' in section
    assert reverse("django_rq:home") in page

    values = metrics(admin_client.get("/metrics").content.decode())
    assert values[("batchweb_workers", (("model", "echo-test"),))] == 1
    assert values[("batchweb_workers_total", ())] == 1
    assert sum(v for (name, labels), v in values.items()
               if name == "batchweb_shards_in_flight") >= 1
    openai_client.batches.cancel(batch.id)  # so the worker stops quickly


@pytest.mark.django_db
def test_queue_health_without_redis_still_shows_the_database(admin_client, user, tmp_path,
                                                            monkeypatch):
    batch = make_batch(user, lines(1), tmp_path)
    Shard.objects.filter(batch=batch).update(status=Shard.Status.RUNNING, worker="w",
                                             heartbeat_at=timezone.now(),
                                             started_at=timezone.now())

    def down(*args, **kwargs):
        raise ConnectionError("Redis is down")

    monkeypatch.setattr(health, "_workers", down)
    page = admin_client.get("/admin/jobs/shard/health/").content.decode()
    assert "Redis did not answer" in page and batch.pk in page


# --- metrics ---


@pytest.mark.django_db
def test_metrics_needs_a_token_or_staff(client, admin_client, user, settings):
    settings.BATCHWEB = {**settings.BATCHWEB, "METRICS_TOKEN": "s3cret-token"}
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer wrong").status_code == 401
    response = client.get("/metrics", HTTP_AUTHORIZATION="Bearer s3cret-token")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain; version=")
    client.force_login(user)  # signed in, but not staff
    assert client.get("/metrics").status_code == 401
    assert admin_client.get("/metrics").status_code == 200
    settings.BATCHWEB = {**settings.BATCHWEB, "METRICS_TOKEN": ""}
    client.logout()
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer ").status_code == 401


@pytest.mark.django_db
def test_metrics_content(admin_client, user, tmp_path, settings):
    done = run_batch(make_batch(user, lines(3), tmp_path))  # 3 completed, 5+3 tokens each
    running = make_batch(user, lines(4), tmp_path, shard_size=2, settings=settings)
    run_batch(running, only=1)
    Shard.objects.filter(batch=running, index=1).update(
        status=Shard.Status.RUNNING, heartbeat_at=timezone.now() - timedelta(minutes=5))
    queues.enqueue_shard("shard_fake", "echo-test.high")
    WebhookEvent.objects.create(owner=user, type="batch.completed", batch_id=done.pk)

    values = metrics(admin_client.get("/metrics").content.decode())

    assert values[("batchweb_batches", (("status", "completed"),))] == 1
    assert values[("batchweb_batches", (("status", "in_progress"),))] == 1
    assert values[("batchweb_batches", (("status", "cancelled"),))] == 0
    assert values[("batchweb_queue_depth", (("model", "echo-test"), ("priority", "high"),
                                            ("queue", "echo-test.high")))] == 1
    assert values[("batchweb_queue_depth", (("model", ""), ("priority", "control"),
                                            ("queue", "batchweb")))] >= 0
    assert values[("batchweb_shards_in_flight", (("model", "echo-test"),
                                                 ("state", "running")))] == 1
    echo = (("model", "echo-test"),)
    assert values[("batchweb_requests_processed_total",
                   (("model", "echo-test"), ("outcome", "completed")))] == 5
    assert values[("batchweb_requests_processed_total",
                   (("model", "echo-test"), ("outcome", "failed")))] == 0
    assert values[("batchweb_tokens_processed_total",
                   (("kind", "input"), ("model", "echo-test")))] == 25
    assert values[("batchweb_tokens_processed_total",
                   (("kind", "output"), ("model", "echo-test")))] == 15
    # run_shard dates the shards' end ten seconds after they started, i.e. now.
    assert values[("batchweb_throughput_requests_per_second", echo)] == pytest.approx(5 / 300)
    assert values[("batchweb_workers", echo)] == 0
    assert values[("batchweb_shards_stuck", echo)] == 1  # its heartbeat is stale
    assert values[("batchweb_webhook_events", (("status", "pending"),))] == 1
    assert values[("batchweb_redis_up", ())] == 1
    assert Batch.objects.count() == 2


# --- the reconciler's periodic share ---


@pytest.mark.django_db
def test_periodic_operations_enqueue_due_webhooks_and_cleanup(user, settings):
    settings.BATCHWEB = {**settings.BATCHWEB, "CLEANUP_INTERVAL_SECONDS": 3600}
    due = WebhookEvent.objects.create(owner=user, type="batch.completed", batch_id="batch_a",
                                      next_attempt_at=timezone.now())
    WebhookEvent.objects.create(owner=user, type="batch.failed", batch_id="batch_b",
                                next_attempt_at=timezone.now() + timedelta(minutes=5))
    assert periodic_operations() == {"webhooks": 1, "cleanup": 1}
    assert queues.queue(queues.CONTROL_QUEUE).job_ids == ["batchweb-cleanup"]
    assert queues.queue(queues.WEBHOOK_QUEUE).job_ids == [f"{due.pk}-webhook"]
    assert periodic_operations() == {"webhooks": 1, "cleanup": 0}


@pytest.mark.django_db
def test_the_reconciler_runs_the_periodic_operations(user):
    """Needs the two-line hook in jobs/services/reconcile.py (see the report)."""
    from jobs.services.reconcile import reconcile

    due = WebhookEvent.objects.create(owner=user, type="batch.completed", batch_id="batch_a",
                                      next_attempt_at=timezone.now())
    done = reconcile()
    assert done["webhooks"] == 1 and done["cleanup"] == 1
    assert f"{due.pk}-webhook" in queues.queue(queues.WEBHOOK_QUEUE).job_ids
