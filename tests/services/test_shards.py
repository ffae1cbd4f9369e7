"""Shard state transitions on the real database: fencing by attempt, retries with backoff,
abandoning after the last attempt, handing back, checkpoints handed on to the next attempt,
and what finalization writes for each; and resume across real worker processes (SIGKILL,
SIGTERM), counted from the echo engine's own request log."""

from __future__ import annotations

import json
import signal

import pytest
from django.core.files.base import ContentFile
from django.core.files.storage import default_storage
from django.utils import timezone

from jobs.formats.checkpoint_record import Checkpoint, Progress
from jobs.models import Batch, Shard, UsageRecord
from jobs.services import shards as shard_service
from jobs.services.batches import create_batch
from jobs.services.files import create_input_file
from jobs.services.finalize import finalize_batch
from jobs.services.validation import run_validation
from jobs.storage.objects import open_file
from tests.factories import (
    assert_charged_once,
    assert_exactly_once,
    chat_line,
    computed_twice,
    engine_request_log,
    heartbeat,
    jsonl,
    make_batch,
    wait_for,
)

pytestmark = pytest.mark.django_db


@pytest.fixture
def batch(user, tmp_path, settings):
    settings.BATCHWEB = {**settings.BATCHWEB, "SHARD_SIZE": 2, "SHARD_MAX_ATTEMPTS": 3}
    return make_batch(user, [chat_line(f"r{i}", "x") for i in range(4)], tmp_path)


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
    assert heartbeat(shard_id=shard.pk, attempt=1, progress=Progress()) == (
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
    # The shards handed back in the drain are charged once, by the worker that finished them.
    assert_charged_once(created.id, [json.loads(line) for line in out])


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
    heartbeat(shard_id=first.pk, attempt=1,
                            progress=Progress(completed=1, input_tokens=7, output_tokens=3,
                                              cached_tokens=5, cacheable_tokens=6,
                                              reasoning_tokens=2))
    assert sums_agree() == {"completed": 1, "failed": 0, "input_tokens": 7,
                            "output_tokens": 3, "cached_tokens": 5, "cacheable_tokens": 6,
                            "reasoning_tokens": 2}
    shard_service.fail_shard(shard_id=first.pk, attempt=1, reason="lost")  # retried: reset
    assert sums_agree()["completed"] == 0
    Shard.objects.filter(pk=first.pk).update(not_before=None)
    shard_service.claim_shard(shard_id=first.pk, worker="w2")
    heartbeat(shard_id=first.pk, attempt=2, progress=Progress(completed=1))
    shard_service.release_shard(shard_id=first.pk, attempt=2)  # handed back: reset
    assert sums_agree()["completed"] == 0
    shard_service.claim_shard(shard_id=first.pk, worker="w3")
    # The stale worker of attempt 1 writes nothing, the batch row neither.
    heartbeat(shard_id=first.pk, attempt=1, progress=Progress(completed=2))
    assert sums_agree()["completed"] == 0
    shard_service.finish_shard(shard_id=first.pk, attempt=3, output_part="", error_part="",
                               progress=Progress(completed=1, failed=1, input_tokens=9,
                                                 output_tokens=4, cached_tokens=6))
    for attempt in (1, 2, 3):  # the other shard runs out of attempts: all failed
        Shard.objects.filter(pk=second.pk).update(not_before=None)
        shard_service.claim_shard(shard_id=second.pk, worker="w")
        heartbeat(shard_id=second.pk, attempt=attempt,
                                progress=Progress(completed=1))
        shard_service.fail_shard(shard_id=second.pk, attempt=attempt, reason="boom")
    assert sums_agree() == {"completed": 1, "failed": 3, "input_tokens": 9,
                            "output_tokens": 4, "cached_tokens": 6, "cacheable_tokens": 0,
                            "reasoning_tokens": 0}


@pytest.mark.django_db(transaction=True)  # the retry closes the connection
def test_a_claim_cut_off_at_any_statement_is_undone_and_retried(batch, monkeypatch):
    """The connection drops in the middle of a claim (a backend terminated), before any one
    of its statements: the worker's retry must get the shard, never find it running and
    leave it to the heartbeat timeout."""
    from django.db import OperationalError, connection

    from jobs.worker.db import with_db_retry

    monkeypatch.setattr("jobs.worker.db.time.sleep", lambda seconds: None)
    shard = first_shard(batch)

    def statements() -> int:
        count = 0

        def counting(execute, sql, params, many, context):  # noqa: ANN001
            nonlocal count
            count += 1
            return execute(sql, params, many, context)

        with connection.execute_wrapper(counting):
            assert shard_service.claim_shard(shard_id=shard.pk, worker="w") is not None
        Shard.objects.filter(pk=shard.pk).update(status="queued", attempt=0, worker="",
                                                 enqueued_at=None)
        return count

    total = statements()
    assert total >= 2
    for cut in range(1, total + 1):
        seen = 0

        def drops_at_cut(execute, sql, params, many, context, cut=cut):  # noqa: ANN001
            nonlocal seen
            seen += 1
            if seen == cut:
                raise OperationalError("terminating connection due to administrator command")
            return execute(sql, params, many, context)

        with connection.execute_wrapper(drops_at_cut):
            claimed = with_db_retry(lambda: shard_service.claim_shard(shard_id=shard.pk,
                                                                      worker="w"))
        assert claimed is not None, f"cut before statement {cut} of {total}"
        assert (claimed.status, claimed.attempt, claimed.worker) == ("running", 1, "w")
        shard.refresh_from_db()
        assert (shard.status, shard.attempt, shard.worker) == ("running", 1, "w")
        Shard.objects.filter(pk=shard.pk).update(status="queued", attempt=0, worker="",
                                                 enqueued_at=None)


def test_checkpoints_are_fenced_and_handed_on_by_the_claim(batch):
    shard = first_shard(batch)
    shard_service.claim_shard(shard_id=shard.pk, worker="w1")
    segment = default_storage.save("parts/x.out", ContentFile(b"{}\n"))
    saved = Checkpoint(attempt=1, segments=[(segment, "", "")], lines={1},
                       progress=Progress(completed=1, input_tokens=5, output_tokens=2),
                       flag_counts={"length_limit": 1}, json_retries=0)
    assert shard_service.record_checkpoint(shard_id=shard.pk, attempt=1, checkpoint=saved,
                                           unsaved=0)
    heartbeat(shard_id=shard.pk, attempt=1, progress=Progress(completed=2),
                            unsaved=1)
    # The worker is lost: the request it computed past its checkpoint is computed again.
    shard_service.fail_shard(shard_id=shard.pk, attempt=1, reason="worker lost")
    shard.refresh_from_db()
    assert (shard.status, shard.recomputed, shard.computed_unsaved) == ("queued", 1, 0)
    assert Checkpoint.from_json(shard.checkpoint) == saved
    # Meanwhile the shard (and the batch) keep the checkpoint's counters.
    assert (shard.completed, shard.input_tokens) == (1, 5)
    assert Batch.objects.get(pk=batch.pk).completed == 1
    Shard.objects.filter(pk=shard.pk).update(not_before=None)
    claimed = shard_service.claim_shard(shard_id=shard.pk, worker="w2")
    assert claimed.attempt == 2 and Checkpoint.from_json(claimed.checkpoint) == saved
    assert (claimed.completed, claimed.output_tokens) == (1, 2)
    # The lost worker wakes up: its late checkpoint lands nowhere.
    late = Checkpoint(attempt=1, lines={1, 2}, progress=Progress(completed=2))
    assert not shard_service.record_checkpoint(shard_id=shard.pk, attempt=1, checkpoint=late)
    shard.refresh_from_db()
    assert Checkpoint.from_json(shard.checkpoint) == saved
    # Handed back with a fresh checkpoint: kept for the next attempt, nothing lost.
    fresh = Checkpoint(attempt=2, segments=saved.segments, lines={1, 2},
                       progress=Progress(completed=2, input_tokens=9, output_tokens=4))
    assert shard_service.record_checkpoint(shard_id=shard.pk, attempt=2, checkpoint=fresh)
    shard_service.release_shard(shard_id=shard.pk, attempt=2, unsaved=0)
    shard.refresh_from_db()
    assert (shard.status, shard.failures, shard.recomputed, shard.completed) == (
        "queued", 1, 1, 2)
    assert Checkpoint.from_json(shard.checkpoint) == fresh
    # Finishing clears it: the parts hold its results now.
    shard_service.claim_shard(shard_id=shard.pk, worker="w3")
    assert shard_service.finish_shard(shard_id=shard.pk, attempt=3, output_part="",
                                      error_part="", progress=Progress(completed=2))
    shard.refresh_from_db()
    assert shard.checkpoint == {} and shard.recomputed == 1
    # Late finishes (a zombie's, a call retried after its commit) charge nothing more.
    for attempt in (1, 2, 3):
        assert not shard_service.finish_shard(shard_id=shard.pk, attempt=attempt,
                                              output_part="", error_part="",
                                              progress=Progress(completed=2, input_tokens=9))
    [record] = UsageRecord.objects.filter(shard_id=shard.pk)
    assert (record.requests_succeeded, record.input_tokens) == (2, 0)


RESUME_LINES = 60
# One shard computed by 2 requests at a time, 0.1 s each (about 20 requests/s), saved
# every 5 results (or second).
RESUME_ENV = {"BATCHWEB_SHARD_SIZE": str(RESUME_LINES), "BATCHWEB_ECHO_SECONDS": "0.1",
              "BATCHWEB_ECHO_MAX_IN_FLIGHT": "2", "BATCHWEB_CHECKPOINT_SECONDS": "1",
              "BATCHWEB_CHECKPOINT_REQUESTS": "5"}


def _resume_batch(openai_client):
    import io

    lines = [chat_line(f"k{i}", f"q {i}", max_tokens=3) for i in range(RESUME_LINES)]
    lines[7] = chat_line("same-1", "identical", temperature=0)
    lines[50] = chat_line("same-2", "identical", temperature=0)
    file_id = openai_client.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))),
                                         purpose="batch").id
    created = openai_client.batches.create(input_file_id=file_id,
                                           endpoint="/v1/chat/completions",
                                           completion_window="24h")
    return created, {line["custom_id"] for line in lines}


def _finish_and_check(openai_client, workers, created, expected, env) -> list[Shard]:
    workers.start(env=env)
    batch = wait_for(lambda: (b := openai_client.batches.retrieve(created.id)).status ==
                     "completed" and b, timeout=90, message="completion")
    out = [json.loads(x) for x in openai_client.files.content(batch.output_file_id).text
           .splitlines()]
    assert batch.error_file_id is None
    assert_exactly_once(out, [], expected)
    # Usage counts each computed request once, however many attempts the shard took.
    computed = [r["response"]["body"]["usage"] for r in out if r["custom_id"] != "same-2"]
    assert batch.usage.input_tokens == sum(u["prompt_tokens"] for u in computed)
    assert batch.usage.output_tokens == sum(u["completion_tokens"] for u in computed)
    # The ledger charged each computed request once, whichever attempt finished its shard.
    assert_charged_once(created.id, out, copies={"same-2"})
    return list(Shard.objects.filter(batch_id=created.id).order_by("index"))


@pytest.mark.django_db(transaction=True)
def test_a_claim_drops_a_checkpoint_whose_segment_is_lost(batch):
    # Its segments are read only when the shard finishes: handed on, a lost one would fail
    # every later attempt. The row forgets it and the attempt runs the shard whole.
    shard = first_shard(batch)
    shard_service.claim_shard(shard_id=shard.pk, worker="w1")
    segment = default_storage.save("parts/lost.out", ContentFile(b"{}\n"))
    saved = Checkpoint(attempt=1, segments=[(segment, "", "")], lines={1},
                       progress=Progress(completed=1, input_tokens=5, output_tokens=2))
    assert shard_service.record_checkpoint(shard_id=shard.pk, attempt=1, checkpoint=saved)
    shard_service.release_shard(shard_id=shard.pk, attempt=1)
    default_storage.delete(segment)
    claimed = shard_service.claim_shard(shard_id=shard.pk, worker="w2")
    assert claimed.attempt == 2 and claimed.checkpoint == {}
    assert (claimed.completed, claimed.input_tokens) == (0, 0)
    shard.refresh_from_db()
    assert shard.checkpoint == {} and shard.completed == 0
    assert Batch.objects.get(pk=batch.pk).completed == 0


def test_sigkill_at_half_a_shard_recomputes_at_most_one_checkpoint_interval(
        openai_client, workers, tmp_path):
    created, expected = _resume_batch(openai_client)
    log = tmp_path / "requests.log"
    # 0.25 s a request (8 results a second): results that arrive while a checkpoint is
    # being stored are not in it, and on a loaded machine a store can take 100-200 ms.
    env = {**RESUME_ENV, "BATCHWEB_ECHO_SECONDS": "0.25",
           "BATCHWEB_ECHO_REQUEST_LOG": str(log)}
    first = workers.start(env=env)
    wait_for(lambda: len(engine_request_log(log)) >= RESUME_LINES // 2, timeout=60,
             every=0.05, message="half the shard computed")
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=10)
    before_kill = len(engine_request_log(log))
    [shard] = _finish_and_check(openai_client, workers, created, expected,
                                {**env, "BATCHWEB_ECHO_SECONDS": "0"})
    twice = computed_twice(log)
    # At most what the worker got since its last checkpoint (one interval: 5 results),
    # plus what the engine had computed and not yet handed over (its 2 in flight).
    assert twice <= 5 + 2, (twice, before_kill)
    assert before_kill >= RESUME_LINES // 2 and shard.attempt == 2 and shard.failures == 1
    # The run report counts the recomputed requests (as the lost worker last reported).
    assert shard.recomputed <= twice


@pytest.mark.django_db(transaction=True)
def test_sigterm_hands_back_a_checkpoint_and_nothing_is_computed_twice(
        openai_client, workers, tmp_path):
    created, expected = _resume_batch(openai_client)
    log = tmp_path / "requests.log"
    # Shards of 8 and an engine batch of 5, 3 s a request: a shard's job returns (and RQ
    # lets the worker stop) once fewer than 5 of its requests are left, so when the drain's
    # short timeout ends, the shard in flight has 7 results written and 1 in the engine.
    env = {**RESUME_ENV, "BATCHWEB_SHARD_SIZE": "8", "BATCHWEB_ECHO_SECONDS": "3",
           "BATCHWEB_ECHO_MAX_IN_FLIGHT": "5", "BATCHWEB_ECHO_REQUEST_LOG": str(log)}
    first = workers.start(env=env, args=["--drain-seconds", "0.1"])
    wait_for(lambda: len(engine_request_log(log)) >= 5, timeout=60, every=0.05,
             message="a first engine step")
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=30) == 0
    handed_back = Shard.objects.filter(batch_id=created.id, status="queued", attempt=1)
    assert not Shard.objects.filter(batch_id=created.id, failures__gt=0).exists()
    kept = {shard.pk: len(Checkpoint.from_json(shard.checkpoint).lines)
            for shard in handed_back}
    assert any(kept.values()), kept
    shards = _finish_and_check(openai_client, workers, created, expected,
                               {**env, "BATCHWEB_ECHO_SECONDS": "0"})
    assert computed_twice(log) == 0
    assert len(engine_request_log(log)) == RESUME_LINES - 1  # one identical request
    assert all(shard.recomputed == 0 for shard in shards)


@pytest.mark.engine
@pytest.mark.django_db(transaction=True)
def test_vllm_worker_sigkilled_at_half_a_shard_resumes_from_its_checkpoint(
        user, workers, settings, tmp_path):
    """The SIGKILL case with the real engine: the worker that takes the shard over adopts
    the killed one's checkpoint and computes only what it lacks."""
    import re

    import psutil


    model = "SmolLM2-135M-Instruct"
    n = 48
    settings.BATCHWEB = {**settings.BATCHWEB, "SHARD_SIZE": n}
    path = tmp_path / "input.jsonl"
    # Lengths from 8 to 102 tokens: results come out one by one, not as one batch at the
    # end, so the kill lands with half of them written.
    path.write_bytes(jsonl([chat_line(f"v{i}", f"Write a long poem about the number {i}.",
                                      model=model, max_tokens=8 + 2 * i, temperature=0)
                            for i in range(n)]))
    file = create_input_file(owner=user, path=path, filename="in.jsonl", purpose="batch")
    created = create_batch(owner=user, input_file_id=file.pk,
                           endpoint="/v1/chat/completions", completion_window="24h")
    run_validation(batch_id=created.pk)
    env = {"BATCHWEB_DTYPE": "float32", "VLLM_CPU_KVCACHE_SPACE": "1",
           "BATCHWEB_HEARTBEAT_TIMEOUT_SECONDS": "10", "BATCHWEB_CHECKPOINT_SECONDS": "1",
           "BATCHWEB_CHECKPOINT_REQUESTS": "4"}
    worker = workers.start(model, env=env)
    shard = Shard.objects.get(batch_id=created.pk)
    wait_for(lambda: Shard.objects.filter(pk=shard.pk, status="running",
                                          completed__gte=n // 2).exists(),
             timeout=600, every=0.2, message="half the shard generated")
    tree = [worker.pid, *(c.pid for c in psutil.Process(worker.pid).children(recursive=True))]
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    shard.refresh_from_db()
    seen = shard.completed  # as the killed worker last reported
    assert shard.status == "running" and seen < n
    wait_for(lambda: not any(psutil.pid_exists(pid) and psutil.Process(pid).status() !=
                             psutil.STATUS_ZOMBIE for pid in tree),
             timeout=60, every=0.5, message="the killed worker's engine core to exit")
    workers.start(model, env=env)
    wait_for(lambda: Batch.objects.get(pk=created.pk).status == "completed", timeout=900,
             every=1, message="completion")
    batch = Batch.objects.get(pk=created.pk)
    with open_file(batch.output_file) as stream:
        out = [json.loads(line) for line in stream]
    assert_exactly_once(out, [], {f"v{i}" for i in range(n)})
    assert_charged_once(created.pk, out)
    assert all(r["response"]["body"]["choices"][0]["message"]["content"] for r in out)
    log = (tmp_path / "worker-1.log").read_text(errors="replace")
    adopted = int(re.search(r"attempt 2 adopts (\d+) results of attempt 1", log)[1])
    shard.refresh_from_db()
    assert (shard.attempt, shard.failures) == (2, 1)
    # The takeover kept what the killed attempt had checkpointed: all it had reported but
    # at most one checkpoint interval (4 results; results come out about one at a time).
    assert adopted >= seen - 4 - 2, (adopted, seen)
    assert shard.recomputed <= n - adopted
