"""Several models on one worker (`batchworker --model A --model B`): one engine loaded at a
time, a switch once the loaded model's queues are empty and another's shards have waited
BATCHWEB_MODEL_SWITCH_SECONDS, no claimed shard dropped, and a model on standby never
reported as having no worker."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.utils import timezone

from jobs.models import Shard
from jobs.queries import queue_health
from jobs.worker.db import ShardStore
from jobs.worker.switching import model_due
from tests.factories import (
    assert_exactly_once,
    chat_line,
    make_batch,
    submit,
    wait_for,
    wait_status,
)

ECHO = {"backend": "echo", "endpoints": ["/v1/chat/completions"],
        "options": {"seconds_per_request": 0.02, "max_in_flight": 4}}


@pytest.fixture
def two_models(settings, tmp_path) -> dict[str, str]:
    """Two echo models, declared to this process and (by file) to the workers it starts."""
    models = [{"name": "echo-test", **ECHO}, {"name": "echo-other", **ECHO}]
    settings.BATCHWEB_MODELS = models
    path = tmp_path / "models.json"
    path.write_text(json.dumps(models))
    return {"BATCHWEB_MODELS_FILE": str(path), "BATCHWEB_ECHO_MODEL": "0",
            "BATCHWEB_MODEL_SWITCH_SECONDS": "1", "BATCHWEB_SHARD_SIZE": "10"}


def lines_for(model: str, count: int) -> list[dict]:
    return [chat_line(f"{model}-{i}", f"question {i}", model=model, max_tokens=2)
            for i in range(count)]


def outputs(client, batch) -> tuple[list[dict], list[dict]]:
    def read(file_id):
        if file_id is None:
            return []
        return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]
    return read(batch.output_file_id), read(batch.error_file_id)


@pytest.mark.django_db(transaction=True)
def test_one_worker_runs_two_models_one_at_a_time(openai_client, workers, two_models):
    first = submit(openai_client, lines_for("echo-test", 60))
    second = submit(openai_client, lines_for("echo-other", 30))
    proc = workers.start("echo-test", env=two_models, args=["--model", "echo-other"])
    # While the first model runs, the second waits on a worker that will switch to it.
    wait_for(lambda: Shard.objects.filter(batch_id=first.id, status="running").exists(),
             timeout=60, message="the first model's shards running")
    # (From the worker's first presence beat on, a heartbeat after it registers.)
    def no_blocker() -> bool:
        queue_health._blockers.clear()
        return queue_health.progress_blocker("echo-other") == ""

    wait_for(no_blocker, timeout=10, message="the second model on standby")
    other = next(m for m in queue_health.queue_health().models if m.model == "echo-other")
    assert other.standby and not other.workers and not other.blocked
    for batch, model, count in ((first, "echo-test", 60), (second, "echo-other", 30)):
        done = wait_status(openai_client, batch.id, {"completed"}, timeout=120)
        out, err = outputs(openai_client, done)
        assert_exactly_once(out, err, {f"{model}-{i}" for i in range(count)})
        assert err == []
        # Nothing claimed was dropped at a switch: every shard ran once.
        assert set(Shard.objects.filter(batch_id=batch.id).values_list(
            "attempt", flat=True)) == {1}
    assert proc.poll() is None
    log = (workers.log_dir / "worker-0.log").read_text()
    assert "switching from echo-test to echo-other" in log
    # The worker loaded each model's engine in turn, one at a time.
    assert log.index("loading echo-test") < log.index("switching from echo-test") < (
        log.rindex("loading echo-other"))


@pytest.mark.django_db
def test_a_model_is_due_once_its_oldest_shard_waited_long_enough(user, tmp_path, settings):
    settings.BATCHWEB_MODELS = [{"name": "echo-test", **ECHO}, {"name": "echo-other", **ECHO}]
    from jobs.lib.model_registry import model_spec

    other = model_spec("echo-other")
    assert other is not None
    store = ShardStore(worker="w")
    batch = make_batch(user, lines_for("echo-other", 3), tmp_path, settings=settings)
    shard = Shard.objects.get(batch=batch)
    # Not yet in Redis (fair share keeps it in the database): nothing is due.
    Shard.objects.filter(pk=shard.pk).update(enqueued_at=None)
    assert model_due([other], waited_seconds=5, store=store) is None
    Shard.objects.filter(pk=shard.pk).update(enqueued_at=timezone.now())
    assert model_due([other], waited_seconds=5, store=store) is None
    Shard.objects.filter(pk=shard.pk).update(
        enqueued_at=timezone.now() - timedelta(seconds=6))
    assert model_due([other], waited_seconds=5, store=store) == other
    Shard.objects.filter(pk=shard.pk).update(status=Shard.Status.RUNNING)
    assert model_due([other], waited_seconds=5, store=store) is None
