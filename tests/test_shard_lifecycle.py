"""Shard state transitions on the real database: fencing by attempt, retries with backoff,
abandoning after the last attempt, handing back, and what finalization writes for each."""

from __future__ import annotations

import json
import signal

import pytest
from django.core.files.storage import default_storage
from django.utils import timezone

from jobs.models import Batch, Shard
from jobs.services import shards as shard_service
from jobs.services.batches import create_batch, finalize_batch, run_validation
from jobs.services.files import create_input_file, open_file
from jobs.services.shards import Progress
from tests.helpers import chat_line, jsonl, wait_for

pytestmark = pytest.mark.django_db


@pytest.fixture
def batch(user, tmp_path, settings):
    settings.BATCHWEB = {**settings.BATCHWEB, "SHARD_SIZE": 2, "SHARD_MAX_ATTEMPTS": 3}
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl([chat_line(f"r{i}", "x") for i in range(4)]))
    file = create_input_file(owner=user, path=path, filename="in.jsonl", purpose="batch")
    created = create_batch(owner=user, input_file_id=file.pk, endpoint="/v1/chat/completions",
                           completion_window="24h")
    run_validation(batch_id=created.pk)
    return Batch.objects.get(pk=created.pk)


def first_shard(batch: Batch) -> Shard:
    return Shard.objects.get(batch=batch, index=0)


def test_claim_is_exclusive_and_fenced(batch):
    shard = first_shard(batch)
    mine = shard_service.claim_shard(shard_id=shard.pk, worker="w1")
    assert mine.attempt == 1 and mine.status == "running"
    assert shard_service.claim_shard(shard_id=shard.pk, worker="w2") is None
    # The worker is presumed dead; its shard is retried and claimed by another.
    shard_service.fail_shard(shard_id=shard.pk, attempt=1, reason="worker lost")
    Shard.objects.filter(pk=shard.pk).update(not_before=None)
    theirs = shard_service.claim_shard(shard_id=shard.pk, worker="w2")
    assert theirs.attempt == 2
    # The first worker wakes up: none of its writes land.
    assert not shard_service.finish_shard(shard_id=shard.pk, attempt=1, output_part="x",
                                          error_part="", progress=Progress(completed=2))
    assert shard_service.heartbeat(shard_id=shard.pk, attempt=1, progress=Progress()) == (
        False, "")
    shard.refresh_from_db()
    assert (shard.status, shard.attempt, shard.worker, shard.output_part) == (
        "running", 2, "w2", "")


def test_failures_back_off_then_abandon_with_shard_failed_lines(batch):
    shard = first_shard(batch)
    delays = []
    for attempt in (1, 2, 3):
        Shard.objects.filter(pk=shard.pk).update(not_before=None)
        claimed = shard_service.claim_shard(shard_id=shard.pk, worker="w")
        assert claimed.attempt == attempt
        before = timezone.now()
        shard_service.fail_shard(shard_id=shard.pk, attempt=attempt, reason="engine exploded")
        shard.refresh_from_db()
        if shard.status == "queued":
            delays.append((shard.not_before - before).total_seconds())
    assert shard.status == "abandoned"
    assert shard.end_code == "shard_failed" and shard.failures == 3
    assert shard.failed == shard.request_count == 2
    assert delays[1] > delays[0] * 1.5  # exponential backoff

    # The other shard succeeds; the batch still completes, the failed requests in errors.
    other = Shard.objects.get(batch=batch, index=1)
    shard_service.claim_shard(shard_id=other.pk, worker="w")
    part = default_storage.save("parts/test.out", __import__("io").BytesIO(
        b'{"custom_id": "r2"}\n{"custom_id": "r3"}\n'))
    assert shard_service.finish_shard(shard_id=other.pk, attempt=1, output_part=part,
                                      error_part="", progress=Progress(completed=2))
    done = finalize_batch(batch_id=batch.pk)
    assert done.status == "completed"
    with open_file(done.error_file) as stream:
        errors = [json.loads(line) for line in stream]
    assert [e["custom_id"] for e in errors] == ["r0", "r1"]
    assert all(e["error"]["code"] == "shard_failed" for e in errors)
    assert "engine exploded" in errors[0]["error"]["message"]
    assert done.to_openai()["request_counts"] == {"total": 4, "completed": 2, "failed": 2}


def test_hand_back_is_not_a_failure(batch):
    shard = first_shard(batch)
    shard_service.claim_shard(shard_id=shard.pk, worker="w")
    shard_service.release_shard(shard_id=shard.pk, attempt=1)
    shard.refresh_from_db()
    assert (shard.status, shard.failures, shard.not_before) == ("queued", 0, None)
    assert shard.enqueued_at is not None  # back in line at once


def test_finalize_waits_for_running_shards(batch):
    shard_service.claim_shard(shard_id=first_shard(batch).pk, worker="w")
    assert finalize_batch(batch_id=batch.pk).status == "in_progress"


@pytest.mark.django_db(transaction=True)
def test_sigterm_hands_back_and_another_worker_finishes(openai_client, workers):
    import io

    lines = [chat_line(f"t{i}", f"q {i}") for i in range(40)]
    file_id = openai_client.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))),
                                         purpose="batch").id
    created = openai_client.batches.create(input_file_id=file_id,
                                           endpoint="/v1/chat/completions",
                                           completion_window="24h")
    slow = {"BATCHWEB_SHARD_SIZE": "10", "BATCHWEB_ECHO_SECONDS": "0.3",
            "BATCHWEB_ECHO_MAX_IN_FLIGHT": "2"}
    first = workers.start(env=slow, args=["--drain-seconds", "0.5"])
    wait_for(lambda: Shard.objects.filter(batch_id=created.id, completed__gt=0).exists(),
             timeout=60, message="progress")
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=30) == 0
    assert not Shard.objects.filter(batch_id=created.id, status="running").exists()
    assert not Shard.objects.filter(batch_id=created.id, failures__gt=0).exists()
    workers.start(env={**slow, "BATCHWEB_ECHO_SECONDS": "0"})
    batch = wait_for(lambda: (b := openai_client.batches.retrieve(created.id)).status ==
                     "completed" and b, timeout=60, message="completion")
    out = openai_client.files.content(batch.output_file_id).text.splitlines()
    assert sorted(json.loads(line)["custom_id"] for line in out) == sorted(
        f"t{i}" for i in range(40))


def test_batch_row_keeps_the_shards_sums_through_every_transition(batch):
    """The polled pages and GET /v1/batches read the counts from the batch row; each
    change to a shard's counters (progress, retry, hand-back, abandon, finish, a stale
    worker's fenced writes) must leave it equal to the sums over the shards."""
    from django.db.models import Sum

    from jobs.models import PROGRESS_FIELDS

    def sums_agree() -> dict[str, int]:
        summed = Shard.objects.filter(batch=batch).aggregate(**{k: Sum(k) for k in
                                                                 PROGRESS_FIELDS})
        row = Batch.objects.get(pk=batch.pk).progress()
        assert row == {k: v or 0 for k, v in summed.items()}
        return row

    first, second = Shard.objects.filter(batch=batch).order_by("index")
    shard_service.claim_shard(shard_id=first.pk, worker="w1")
    shard_service.heartbeat(shard_id=first.pk, attempt=1,
                            progress=Progress(completed=1, input_tokens=7, output_tokens=3))
    assert sums_agree() == {"completed": 1, "failed": 0, "input_tokens": 7,
                            "output_tokens": 3}
    shard_service.fail_shard(shard_id=first.pk, attempt=1, reason="lost")  # retried: reset
    assert sums_agree()["completed"] == 0
    Shard.objects.filter(pk=first.pk).update(not_before=None)
    shard_service.claim_shard(shard_id=first.pk, worker="w2")
    shard_service.heartbeat(shard_id=first.pk, attempt=2, progress=Progress(completed=1))
    shard_service.release_shard(shard_id=first.pk, attempt=2)  # handed back: reset
    assert sums_agree()["completed"] == 0
    shard_service.claim_shard(shard_id=first.pk, worker="w3")
    # The stale worker of attempt 1 writes nothing, the batch row neither.
    shard_service.heartbeat(shard_id=first.pk, attempt=1, progress=Progress(completed=2))
    assert sums_agree()["completed"] == 0
    shard_service.finish_shard(shard_id=first.pk, attempt=3, output_part="", error_part="",
                               progress=Progress(completed=1, failed=1, input_tokens=9,
                                                 output_tokens=4))
    for attempt in (1, 2, 3):  # the other shard runs out of attempts: all failed
        Shard.objects.filter(pk=second.pk).update(not_before=None)
        shard_service.claim_shard(shard_id=second.pk, worker="w")
        shard_service.heartbeat(shard_id=second.pk, attempt=attempt,
                                progress=Progress(completed=1))
        shard_service.fail_shard(shard_id=second.pk, attempt=attempt, reason="boom")
    assert sums_agree() == {"completed": 1, "failed": 3, "input_tokens": 9,
                            "output_tokens": 4}


@pytest.mark.django_db(transaction=True)  # the retry closes the connection
def test_a_claim_whose_read_back_fails_is_undone_and_retried(batch, monkeypatch):
    """The connection drops right after the claiming UPDATE (a backend terminated): the
    worker's retry must get the shard, not find it running and leave it to the heartbeat
    timeout."""
    from django.db import OperationalError

    from jobs.worker.db import with_db_retry

    real = shard_service._read_claimed
    calls = []

    def drops_once(shard_id: str) -> Shard:
        calls.append(shard_id)
        if len(calls) == 1:
            raise OperationalError("terminating connection due to administrator command")
        return real(shard_id)

    monkeypatch.setattr(shard_service, "_read_claimed", drops_once)
    monkeypatch.setattr("jobs.worker.db.time.sleep", lambda seconds: None)
    shard = first_shard(batch)
    claimed = with_db_retry(lambda: shard_service.claim_shard(shard_id=shard.pk, worker="w"))
    assert claimed is not None and len(calls) == 2
    assert (claimed.status, claimed.attempt, claimed.worker) == ("running", 1, "w")
