"""The /metrics endpoint: who may read it, and what it counts."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from jobs.lib import queues
from jobs.models import Batch, Shard, WebhookEvent
from tests.factories import chat_lines, make_batch, prometheus_values, register_worker, run_batch


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
    done = run_batch(make_batch(user, chat_lines(3), tmp_path))  # 3 completed, 5+3 tokens each
    running = make_batch(user, chat_lines(4), tmp_path, shard_size=2, settings=settings)
    run_batch(running, only=1)
    Shard.objects.filter(batch=running, index=1).update(
        status=Shard.Status.RUNNING, heartbeat_at=timezone.now() - timedelta(minutes=5))
    queues.enqueue_shard("shard_fake", "echo-test.high")
    WebhookEvent.objects.create(owner=user, type="batch.completed", batch_id=done.pk)

    values = prometheus_values(admin_client.get("/metrics").content.decode())

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


@pytest.mark.django_db
def test_metrics_workers_per_host(admin_client, user, tmp_path, settings):
    # host-a: two live workers, the second re-registered after a Redis outage (RQ name
    # `<name>.1`, its shards still recorded under `<name>`); host-b: one worker silent for
    # longer than the heartbeat timeout (6 s in the tests), as after its machine died.
    register_worker("host-a.1.echo-test", "host-a")
    register_worker("host-a.2.echo-test.1", "host-a")
    register_worker("host-b.1.echo-test", "host-b", heartbeat_age=60)
    batch = make_batch(user, chat_lines(10), tmp_path, shard_size=2, settings=settings)
    shards = list(Shard.objects.filter(batch=batch).order_by("index"))
    for shard, worker in zip(shards, ["host-a.1.echo-test", "host-a.2.echo-test",
                                      "host-a.2.echo-test", "host-b.1.echo-test"], strict=False):
        Shard.objects.filter(pk=shard.pk).update(status=Shard.Status.RUNNING, worker=worker,
                                                 heartbeat_at=timezone.now())

    values = prometheus_values(admin_client.get("/metrics").content.decode())

    def value(name: str, **labels: str) -> float:
        return values[(name, tuple(sorted(labels.items())))]

    assert value("batchweb_host_up", host="host-a") == 1
    assert value("batchweb_host_up", host="host-b") == 0
    # Both hold running shards: busy, whatever RQ's own state (queue health's rule).
    assert value("batchweb_host_workers", host="host-a", model="echo-test", state="busy") == 2
    assert value("batchweb_host_workers", host="host-b", model="echo-test", state="lost") == 1
    assert ("batchweb_host_workers", (("host", "host-b"), ("model", "echo-test"),
                                      ("state", "idle"))) not in values
    assert value("batchweb_host_shards_held", host="host-a") == 3
    assert value("batchweb_host_shards_held", host="host-b") == 1
    assert value("batchweb_host_heartbeat_age_seconds", host="host-a") < 6
    assert value("batchweb_host_heartbeat_age_seconds", host="host-b") >= 60
    # Lost workers are not counted as serving the model.
    assert value("batchweb_workers", model="echo-test") == 2
    assert value("batchweb_workers_total") == 2


def test_metrics_usage_ledger(admin_client, user, tmp_path, settings):
    from jobs.formats.checkpoint_record import Progress
    from jobs.models import Price
    from jobs.services import shards as shard_service

    Price.objects.create(model="echo-test", input_per_million=4, cached_input_per_million=2,
                         output_per_million=8)
    batch = make_batch(user, chat_lines(4), tmp_path, shard_size=2, settings=settings)
    for shard in Shard.objects.filter(batch=batch):
        claimed = shard_service.claim_shard(shard_id=shard.pk, worker="w", top_up=False)
        assert shard_service.finish_shard(
            shard_id=shard.pk, attempt=claimed.attempt, output_part="", error_part="",
            progress=Progress(completed=2, input_tokens=1000, cached_tokens=500,
                              output_tokens=100))
    values = prometheus_values(admin_client.get("/metrics").content.decode())
    echo = ("model", "echo-test")
    assert values[("batchweb_usage_tokens_total", (("kind", "input"), echo))] == 2000
    assert values[("batchweb_usage_tokens_total", (("kind", "cached_input"), echo))] == 1000
    assert values[("batchweb_usage_tokens_total", (("kind", "output"), echo))] == 200
    # (500 x 4 + 500 x 2 + 100 x 8) / 1e6, half off, twice.
    assert values[("batchweb_usage_cost_total", (("currency", "usd"), echo))] == \
        pytest.approx(0.0038)
    assert (("batchweb_usage_engine_seconds_total", (echo,))) in values
