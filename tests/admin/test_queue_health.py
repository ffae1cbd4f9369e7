"""The admin's queue-health page: with a live worker, and without Redis."""

from __future__ import annotations

import io

import pytest
from django.urls import reverse
from django.utils import timezone

from jobs import queues
from jobs.models import Shard
from jobs.queries import health
from tests.factories import chat_lines, jsonl, make_batch, prometheus_values, wait_for


@pytest.mark.django_db(transaction=True)
def test_queue_health_page_with_a_live_worker(admin_client, openai_client, workers):
    from rq import Worker

    # Slow enough that the batch is still running while we look: 6 shards of 100 requests
    # at ~40 requests/s, the worker holding one or two at a time (its inbox is bounded).
    workers.start(env={"BATCHWEB_ECHO_SECONDS": "0.05", "BATCHWEB_ECHO_MAX_IN_FLIGHT": "2",
                       "BATCHWEB_SHARD_SIZE": "100"})
    wait_for(lambda: Worker.count(connection=queues.connection()) == 1, timeout=60,
             message="the worker to register")
    file_id = openai_client.files.create(file=("in.jsonl", io.BytesIO(jsonl(chat_lines(600)))),
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

    values = prometheus_values(admin_client.get("/metrics").content.decode())
    assert values[("batchweb_workers", (("model", "echo-test"),))] == 1
    assert values[("batchweb_workers_total", ())] == 1
    assert sum(v for (name, labels), v in values.items()
               if name == "batchweb_shards_in_flight") >= 1
    openai_client.batches.cancel(batch.id)  # so the worker stops quickly


@pytest.mark.django_db
def test_queue_health_without_redis_still_shows_the_database(admin_client, user, tmp_path,
                                                            monkeypatch):
    batch = make_batch(user, chat_lines(1), tmp_path)
    Shard.objects.filter(batch=batch).update(status=Shard.Status.RUNNING, worker="w",
                                             heartbeat_at=timezone.now(),
                                             started_at=timezone.now())

    def down(*args, **kwargs):
        raise ConnectionError("Redis is down")

    monkeypatch.setattr(health, "_workers", down)
    page = admin_client.get("/admin/jobs/shard/health/").content.decode()
    assert "Redis did not answer" in page and batch.pk in page
