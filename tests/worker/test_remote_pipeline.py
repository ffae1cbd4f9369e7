"""`batchworker` processes on a remote model whose server is the tests' own HTTP server
(tests/faultproxy.py answering chat itself): the fast tier's proof that the pipeline's
guarantees hold with the remote engine (dedup, usage charged once, exactly-once output
through 429s and resets, a SIGKILL with requests in flight, cancel closing the requests
in flight, a server down that the batch waits for). tests/worker/test_remote_worker.py
runs the same against a real `vllm serve`."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import redis
from django.conf import settings as django_settings
from django.utils import timezone

from engine.remote_limits import server_state
from jobs.models import Batch, Shard
from jobs.queries import queue_health
from tests.factories import (
    assert_charged_once,
    assert_exactly_once,
    chat_line,
    free_port,
    read_lines,
    submit,
    wait_for,
    wait_status,
)
from tests.faultproxy import FaultProxy

NAME = "remote-test"


@pytest.fixture
def proxy() -> Iterator[FaultProxy]:
    made = FaultProxy(delay=0.05)
    yield made
    made.close()


def declare(settings: Any, tmp_path: Any, url: str) -> dict[str, str]:
    """The remote model, declared to this process and (by file) to the workers."""
    models = [{"name": NAME, "backend": "remote", "endpoints": ["/v1/chat/completions"],
               "options": {"base_url": url, "max_concurrency": 3, "backoff_base": 0.1,
                           "backoff_max": 1.0, "metrics_url": "",
                           # A killed worker's slots come back after 5 s, not 30.
                           "lease_seconds": 5}}]
    settings.BATCHWEB_MODELS = models
    path = tmp_path / "models.json"
    path.write_text(json.dumps(models))
    return {"BATCHWEB_MODELS_FILE": str(path), "BATCHWEB_ECHO_MODEL": "0",
            "BATCHWEB_SHARD_SIZE": "10"}


def line(custom_id: str, text: str) -> dict:
    return chat_line(custom_id, text, model=NAME, max_tokens=8, temperature=0)


def test_a_batch_through_throttles_and_resets(openai_client, workers, settings, tmp_path,
                                              proxy):
    env = declare(settings, tmp_path, proxy.url)
    lines = [line(f"r{i}", f"question {i}") for i in range(25)]
    lines += [line("dup-a", "question 3"), line("dup-b", "question 4")]
    proxy.faults += [("status", 429, 1), ("reset",), ("status", 503, None), ("reset",)]
    batch = submit(openai_client, lines)
    workers.start(NAME, env=env)
    batch = wait_status(openai_client, batch.id, {"completed"}, timeout=120)
    out, err = read_lines(batch.output_file_id), read_lines(batch.error_file_id)
    assert_exactly_once(out, err, {entry["custom_id"] for entry in lines})
    assert not err and {o["response"]["body"]["model"] for o in out} == {NAME}
    assert Batch.objects.get(pk=batch.id).dedup_saved == 2
    assert_charged_once(batch.id, out, copies={"dup-a", "dup-b"})
    assert len(proxy.posts) == 25 + 4  # each line once, plus the four faults' retries
    assert proxy.most_in_flight <= 3


def test_a_sigkilled_worker_loses_and_doubles_nothing(openai_client, workers, settings,
                                                       tmp_path, proxy):
    env = declare(settings, tmp_path, proxy.url)
    proxy.delay = 0.4
    batch = submit(openai_client, [line(f"k{i}", f"question {i}") for i in range(40)])
    victim = workers.start(NAME, env=env)
    wait_for(lambda: Shard.objects.filter(batch_id=batch.id, status="running",
                                          completed__gt=0).exists() and proxy.in_flight > 0,
             timeout=60, every=0.05, message="a running shard with requests in flight")
    client = redis.Redis.from_url(django_settings.REDIS_URL)
    assert server_state(client, proxy.url, ceiling=3).in_flight > 0
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    proxy.delay = 0.02
    # Its leases are never given back: they expire, and the next worker gets the slots.
    workers.start(NAME, env=env)
    batch = wait_status(openai_client, batch.id, {"completed"}, timeout=180)
    out, err = read_lines(batch.output_file_id), read_lines(batch.error_file_id)
    assert_exactly_once(out, err, {f"k{i}" for i in range(40)})
    assert len(out) == 40 and not err
    assert_charged_once(batch.id, out)
    assert Shard.objects.filter(batch_id=batch.id, failures__gt=0).exists()
    assert proxy.most_in_flight <= 3
    # Every slot comes back: the last results' leases are given back just after they are
    # written, the killed worker's expire (lease_seconds).
    wait_for(lambda: server_state(client, proxy.url, ceiling=3).in_flight == 0, timeout=45,
             message="every lease back")


def test_cancel_closes_the_requests_in_flight(openai_client, workers, settings, tmp_path,
                                              proxy):
    env = declare(settings, tmp_path, proxy.url)
    proxy.delay = 1.0  # 40 requests, 3 at a time: ~14 s, the cancel lands mid-way
    batch = submit(openai_client, [line(f"c{i}", f"question {i}") for i in range(40)])
    workers.start(NAME, env=env)
    wait_for(lambda: openai_client.batches.retrieve(batch.id).request_counts.completed >= 3
             and proxy.in_flight > 0, timeout=60, every=0.05, message="requests in flight")
    openai_client.batches.cancel(batch.id)
    batch = wait_status(openai_client, batch.id, {"cancelled"}, timeout=60)
    out, err = read_lines(batch.output_file_id), read_lines(batch.error_file_id)
    assert_exactly_once(out, err, {f"c{i}" for i in range(40)})
    assert out and all(e["error"]["code"] == "batch_cancelled" for e in err)
    # The answers to the aborted requests found their connections closed.
    wait_for(lambda: proxy.gone > 0, timeout=5, message="an aborted request's connection")


def test_a_batch_waits_for_its_server_and_says_so(openai_client, workers, settings,
                                                  tmp_path):
    port = free_port()
    env = declare(settings, tmp_path, f"http://127.0.0.1:{port}/v1")
    batch = submit(openai_client, [line(f"w{i}", f"question {i}") for i in range(5)])
    workers.start(NAME, env=env)

    def blocker() -> str:
        queue_health._blockers.clear()
        return queue_health.progress_blocker(NAME)

    wait_for(lambda: "cannot be reached" in blocker(), timeout=60,
             message="the batch page's note")
    late = FaultProxy(port=port)
    try:
        batch = wait_status(openai_client, batch.id, {"completed"}, timeout=60)
        assert batch.request_counts.completed == 5
        assert blocker() == ""
        # The window did not close meanwhile: it was a wait, not a failure.
        assert Batch.objects.get(pk=batch.id).expires_at > timezone.now() + timedelta(hours=1)
    finally:
        late.close()
