"""Scaled to zero: with no worker of a model, a new batch must still be validated, or it
never asks for a worker (`batchweb_workers_needed` counts running batches only) and none
comes. `manage.py controlworker` validates it without an engine; only then does the
signal ask for a worker, and the worker that comes runs it."""

from __future__ import annotations

import io
import signal
import time

import pytest

from jobs.capacity import fleet
from jobs.lib import queues
from jobs.models import Batch, Shard
from tests.factories import chat_line, jsonl, prometheus_values, wait_for

pytestmark = pytest.mark.django_db(transaction=True)

NEEDED = ("batchweb_workers_needed", (("model", "echo-test"),))


def workers_needed() -> float:
    from jobs.http.metrics import render_metrics

    return prometheus_values(render_metrics().decode())[NEEDED]


def test_a_batch_at_zero_workers_is_validated_then_asks_for_a_worker_that_runs_it(
        openai_client, workers, settings) -> None:
    from jobs.queries.queue_health import queue_health

    settings.BATCHWEB = {**settings.BATCHWEB, "HEARTBEAT_TIMEOUT_SECONDS": 3}
    assert workers_needed() == 0
    file_id = openai_client.files.create(
        file=("in.jsonl", io.BytesIO(jsonl([chat_line(f"r{i}", f"q {i}") for i in range(30)]))),
        purpose="batch").id
    created = openai_client.batches.create(input_file_id=file_id,
                                           endpoint="/v1/chat/completions",
                                           completion_window="24h")
    # No process takes the control queue: the batch waits in validation, and the signal
    # cannot ask for a worker for it. This is the deadlock the control worker breaks.
    time.sleep(2)
    assert Batch.objects.get(pk=created.id).status == Batch.Status.VALIDATING
    assert workers_needed() == 0

    proc = workers.start_control(env={"BATCHWEB_RECONCILE_SECONDS": "1",
                                      "BATCHWEB_HEARTBEAT_SECONDS": "1"})
    wait_for(lambda: Batch.objects.get(pk=created.id).status == Batch.Status.IN_PROGRESS,
             timeout=60, message="validation by the control worker")
    # Queue health counts it as a worker of the control queue, of no model, and alive
    # while idle past the heartbeat timeout.
    time.sleep(4)
    health = queue_health()
    assert health.control_workers == 1
    assert not [w for m in health.models for w in m.workers + m.lost_workers]
    # Validated on the control tier: its shards wait in the model's queue, none ran (the
    # control worker has no engine and takes no shard queue), and the model now needs a
    # worker.
    shards = Shard.objects.filter(batch_id=created.id)
    assert shards.exists() and not shards.exclude(status=Shard.Status.QUEUED).exists()
    assert queues.queue(queues.shard_queue_name("echo-test", "default")).count >= 1
    assert workers_needed() >= 1
    # Its object says what it waits for, and when it would end after that worker's cold
    # start: never a moment already past (the control worker's reconciler plans it).
    wait_for(lambda: Batch.objects.get(pk=created.id).waits_for == "worker", timeout=30,
             message="the plan of a batch waiting for a worker")
    waiting = openai_client.batches.retrieve(created.id).model_extra
    assert waiting["waits_for"] == "worker" and waiting["expected_completion_at"] >= time.time()

    # The autoscaler's answer: a worker of the model comes and runs the batch; the
    # finalization and the plan's 0 follow.
    workers.start()
    batch = wait_for(lambda: (b := openai_client.batches.retrieve(created.id)).status
                     == "completed" and b, timeout=90, message="completion")
    assert batch.request_counts.completed == 30
    assert workers_needed() == 0
    # Its start is what the next batch waiting for a first worker is planned with, and it
    # is no longer starting.
    assert fleet.cold_start_seconds(queues.connection(), "echo-test") is not None
    assert not queues.connection().hlen(fleet.STARTING_KEY.format(model="echo-test"))

    # SIGTERM stops it promptly and cleanly (a Deployment's rollout, a scale-down).
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
