"""A running batch that cannot make progress says why: on its page, on the admin's queue
health and in /metrics, when no worker for its model is alive or Redis cannot be reached."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from jobs.lib import queues
from jobs.queries import queue_health
from tests.factories import Workers, chat_line, make_batch, register_worker, wait_for

pytestmark = pytest.mark.django_db


def _blocked_metric(client: Any) -> float:
    text = client.get("/metrics").content.decode()
    return next(sample.value for family in text_string_to_metric_families(text)
                for sample in family.samples
                if sample.name == "batchweb_model_blocked"
                and sample.labels == {"model": "echo-test"})


def test_no_worker_is_shown_everywhere_until_one_starts(site: Any, admin_client: Any, user: Any,
                                                        tmp_path: Path) -> None:
    batch = make_batch(user, [chat_line(f"r{i}", "hi") for i in range(3)], tmp_path)
    page = site.get(f"/batches/{batch.pk}/live").content.decode()
    assert 'id="blocker"' in page
    assert "no worker for echo-test is running" in page
    assert _blocked_metric(admin_client) == 1
    assert "no worker for this model is alive" in admin_client.get(
        "/admin/jobs/shard/health/").content.decode()

    workers = Workers(tmp_path)
    workers.start()
    try:
        def unblocked() -> bool:
            queue_health._blockers.clear()
            return queue_health.progress_blocker("echo-test") == ""

        wait_for(unblocked, timeout=60, message="the worker to register")
        # The worker may already have finished the batch: either way nothing says blocked.
        assert 'id="blocker"' not in site.get(f"/batches/{batch.pk}/live").content.decode()
        assert _blocked_metric(admin_client) == 0
    finally:
        workers.stop_all()


def test_a_worker_of_a_dead_host_is_not_counted_as_running(site: Any, user: Any,
                                                           tmp_path: Path) -> None:
    # Its registration outlives it in Redis; its heartbeat stopped a minute ago.
    batch = make_batch(user, [chat_line("r0", "hi")], tmp_path)
    register_worker("host-b.1.echo-test", "host-b", heartbeat_age=60)
    assert "no worker for echo-test is running" in queue_health.progress_blocker("echo-test")
    queue_health._blockers.clear()
    register_worker("host-a.1.echo-test", "host-a")
    assert queue_health.progress_blocker("echo-test") == ""
    assert 'id="blocker"' not in site.get(f"/batches/{batch.pk}/live").content.decode()


def test_an_unreachable_queue_is_named(site: Any, user: Any, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    batch = make_batch(user, [chat_line("r0", "hi")], tmp_path)

    def down() -> Any:
        raise ConnectionError("Redis is down")

    monkeypatch.setattr(queues, "connection", down)
    page = site.get(f"/batches/{batch.pk}/live").content.decode()
    assert "the queue (Redis) cannot be reached" in page
