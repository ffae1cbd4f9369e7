"""The admin's queue-health page: with a live worker, and without Redis."""

from __future__ import annotations

import io
import signal
import time

import pytest
from django.urls import reverse
from django.utils import timezone

from jobs.lib import queues
from jobs.models import Shard
from jobs.queries import queue_health
from jobs.services.stopping import cancel_batch
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
        snapshot = queue_health.queue_health()
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

    monkeypatch.setattr(queue_health, "_workers", down)
    page = admin_client.get("/admin/jobs/shard/health/").content.decode()
    assert "Redis did not answer" in page and batch.pk in page


def _host_section(page: str, host: str) -> str:
    return page.split(f'<tbody id="host-{host}"')[1].split("</tbody>")[0]


@pytest.mark.django_db(transaction=True)
def test_queue_health_shows_workers_per_host_and_a_lost_host(admin_client, user, workers,
                                                             tmp_path, settings):
    from rq import Worker

    env = {"BATCHWEB_ECHO_SECONDS": "0.05", "BATCHWEB_ECHO_MAX_IN_FLIGHT": "2"}
    workers.start(env=env, args=["--host", "host-a"])
    doomed = workers.start(env=env, args=["--host", "host-b"])
    wait_for(lambda: Worker.count(connection=queues.connection()) == 2, timeout=60,
             message="both workers to register")
    batch = make_batch(user, chat_lines(1200), tmp_path, shard_size=50, settings=settings)

    def both_hosts_hold_shards():
        snapshot = queue_health.queue_health()
        hosts = {h.hostname: h for h in snapshot.hosts}
        return set(hosts) == {"host-a", "host-b"} and all(
            h.shards_held >= 1 for h in hosts.values()) and snapshot

    snapshot = wait_for(both_hosts_hold_shards, timeout=60, every=0.1,
                        message="a running shard on each host")
    for host in snapshot.hosts:
        assert not host.lost and host.models == ["echo-test"]
        assert [w.name.split(".")[0] for w in host.workers] == [host.hostname]
        # What a host holds is what the running shards record under its workers' names.
        assert host.shards_held == sum(
            1 for m in snapshot.models for s in m.running
            if s.worker.startswith(host.hostname + "."))

    page = admin_client.get("/admin/jobs/shard/health/").content.decode()
    running_rows = page.split("<th>Shard</th>")[1]
    for host in ("host-a", "host-b"):
        section = _host_section(page, host)
        assert 'class="host"' in page.split(f'<tbody id="host-{host}"')[1][:20]
        assert "of 1 alive" in section and "echo-test" in section
        held = int(section.split('<td class="host-held">')[1].split("<")[0])
        assert held == running_rows.count(f"<td>{host}."), section

    # The machine of host-b dies: its worker is SIGKILLed, so it sends no heartbeat. The
    # batch is cancelled at once, so that host-a is idle while host-b goes silent.
    doomed.send_signal(signal.SIGKILL)
    doomed.wait()
    cancel_batch(batch=batch)
    wait_for(lambda: not Shard.objects.filter(batch=batch, status="running",
                                              worker__startswith="host-a.").exists(),
             timeout=30, message="host-a's shards to stop")
    host_a_idle_since = time.monotonic()

    def host_b_lost():
        page = admin_client.get("/admin/jobs/shard/health/").content.decode()
        return 'id="host-host-b" class="host lost"' in page and page

    page = wait_for(host_b_lost, timeout=30, message="host-b shown as lost")
    assert "<strong>lost</strong>: 1 worker(s) silent" in _host_section(page, "host-b")
    assert '<td class="worker-state"><strong>lost</strong></td>' in _host_section(
        page, "host-b")
    assert 'id="host-host-a" class="host"' in page
    values = prometheus_values(admin_client.get("/metrics").content.decode())
    assert values[("batchweb_host_up", (("host", "host-a"),))] == 1
    assert values[("batchweb_host_up", (("host", "host-b"),))] == 0
    assert values[("batchweb_host_workers", (("host", "host-b"), ("model", "echo-test"),
                                             ("state", "lost")))] == 1
    assert values[("batchweb_workers", (("model", "echo-test"),))] == 1

    # An idle worker is not lost: RQ itself would refresh its heartbeat only when its wait
    # for a job times out (minutes), batchworker's presence thread does every second.
    time.sleep(max(0.0, host_a_idle_since + settings.BATCHWEB["HEARTBEAT_TIMEOUT_SECONDS"] + 2
                   - time.monotonic()))
    alive = next(h for h in queue_health.queue_health().hosts if h.hostname == "host-a")
    assert not alive.lost and alive.workers[0].state == "idle"
    assert alive.heartbeat_age is not None and alive.heartbeat_age.total_seconds() < 3
