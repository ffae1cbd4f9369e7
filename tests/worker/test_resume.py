"""Resume without recomputing, in-process: a shard handed back with a fresh checkpoint and
run by another pipeline computes nothing twice; a worker presumed dead cannot record a late
checkpoint; a checkpoint lost from storage makes the shard run whole. Recomputation is
counted from the echo engine's own request log, not from the output."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from django.core.files.storage import default_storage

from jobs.formats.checkpoint_record import Checkpoint
from jobs.models import Shard
from jobs.services import shards as shard_service
from tests.factories import (
    SHAPES,
    assert_charged_once,
    assert_exactly_once,
    chat_line,
    computed_twice,
    engine_request_log,
    finalized,
    requests_of_shape,
    run_all_shards,
    start_shard,
    wait_for,
)

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def checkpoint_often(settings):
    settings.BATCHWEB = {**settings.BATCHWEB, "CHECKPOINT_SECONDS": 0.5,
                         "CHECKPOINT_REQUESTS": 3}


def lines_with_dedup_and_json(n: int, shape: str = "file order") -> list[dict]:
    lines = requests_of_shape(shape, n, "r")
    # A deterministic duplicate (written under both custom_ids) and JSON requests (their
    # output never parses: each is run twice) across the shard.
    lines[3] = chat_line("dup-a", "same words", temperature=0)
    lines[n - 2] = chat_line("dup-b", "same words", temperature=0)
    for i in (5, n // 2, n - 4):
        lines[i] = chat_line(f"json{i}", f"braces {i}", response_format={"type": "json_object"})
    return lines


@SHAPES
def test_handed_back_shard_resumes_without_computing_anything_twice(
        make_batch, make_pipeline, checkpoint_often, tmp_path, shape):
    lines = lines_with_dedup_and_json(30, shape)
    batch = make_batch(lines, shard_size=30)
    assert batch.plan["grouped"] is (shape == "grouped")
    shard = Shard.objects.get(batch=batch)
    log = tmp_path / "requests.log"
    first = make_pipeline(seconds_per_request=0.3, max_in_flight=2, inbox_size=2,
                          request_log=str(log))
    start_shard(first, shard.pk)
    wait_for(lambda: len(engine_request_log(log)) >= 12, timeout=30, message="half a shard")
    first.hand_back_all()  # as SIGTERM after the drain timeout
    shard.refresh_from_db()
    kept = Checkpoint.from_json(shard.checkpoint)
    assert (shard.status, shard.failures, shard.attempt) == ("queued", 0, 1)
    assert 12 <= len(kept.lines) < 30
    # The counters the checkpoint carries are the shard's (and the batch's) meanwhile.
    assert shard.completed + shard.failed == kept.progress.completed + kept.progress.failed > 0
    first.close()

    second = make_pipeline(request_log=str(log))
    run_all_shards(second, batch)
    assert computed_twice(log) == sum(1 for line in lines if "json" in line["custom_id"])
    done, out, err = finalized(batch)
    assert_exactly_once(out, err, {line["custom_id"] for line in lines})
    assert err == [] and done.status == "completed"
    shard.refresh_from_db()
    assert (shard.attempt, shard.recomputed, shard.json_retries) == (2, 0, 3)
    assert shard.flag_counts.get("invalid_json") == 3 and shard.checkpoint == {}
    # Usage counts each computed request once (the copy is free).
    by_id = {r["custom_id"]: r["response"]["body"]["usage"] for r in out}
    assert done.input_tokens == sum(u["prompt_tokens"] for cid, u in by_id.items()
                                    if cid != "dup-b")
    assert done.output_tokens == sum(u["completion_tokens"] for cid, u in by_id.items()
                                     if cid != "dup-b")
    assert by_id["dup-a"] == by_id["dup-b"]
    # The ledger: the shard charged once, by the attempt that finished it.
    assert_charged_once(batch.pk, out, copies={"dup-b"})
    # The checkpoint's segments were merged into the parts and deleted.
    assert not [name for name in default_storage.listdir(f"parts/{batch.pk}")[1]
                if ".ckpt" in name]


@SHAPES
def test_a_zombie_worker_cannot_record_a_late_checkpoint(
        make_batch, make_pipeline, checkpoint_often, caplog, settings, shape):
    # Its checkpoints would otherwise come only from the periodic thread.
    settings.BATCHWEB = {**settings.BATCHWEB, "CHECKPOINT_SECONDS": 3600,
                         "CHECKPOINT_REQUESTS": 10_000}
    batch = make_batch(requests_of_shape(shape, 20, "z"), shard_size=20)
    assert batch.plan["grouped"] is (shape == "grouped")
    shard = Shard.objects.get(batch=batch)
    zombie = make_pipeline(seconds_per_request=0.1, max_in_flight=2, inbox_size=2)
    start_shard(zombie, shard.pk)
    work = wait_for(lambda: zombie.state.works.get(shard.pk), timeout=10, message="the claim")
    wait_for(lambda: len(work.answered) >= 3, timeout=20, message="first results")
    assert zombie.checkpointer.save(work)
    shard.refresh_from_db()
    recorded = shard.checkpoint
    stored = set(Checkpoint.from_json(recorded).storage_names())
    assert stored and all(default_storage.exists(name) for name in stored)
    # The reconciler presumes the worker dead; another worker claims the shard.
    shard_service.fail_shard(shard_id=shard.pk, attempt=1, reason="worker lost (no heartbeat)")
    Shard.objects.filter(pk=shard.pk).update(not_before=None)
    assert shard_service.claim_shard(shard_id=shard.pk, worker="other").attempt == 2
    wait_for(lambda: work.unsaved_results() > 0 or work.dead, timeout=20,
             message="more results")
    before = set(default_storage.listdir(f"parts/{batch.pk}")[1])
    with caplog.at_level(logging.WARNING):
        assert not zombie.checkpointer.save(work)
    shard.refresh_from_db()
    assert shard.checkpoint == recorded and shard.attempt == 2  # handed on, untouched
    # What the late checkpoint stored is deleted again; the recorded segments stay.
    assert set(default_storage.listdir(f"parts/{batch.pk}")[1]) == before
    assert all(default_storage.exists(name) for name in stored)


def one_slow_shard(make_batch, make_pipeline, n: int, *, seconds: float):
    """A batch of one shard of `n` requests, started on a pipeline that takes `seconds` a
    request, two at a time: (lines, batch, shard, pipeline)."""
    lines = [chat_line(f"l{i}", f"q {i}") for i in range(n)]
    batch = make_batch(lines, shard_size=n)
    shard = Shard.objects.get(batch=batch)
    pipeline = make_pipeline(seconds_per_request=seconds, max_in_flight=2, inbox_size=2)
    start_shard(pipeline, shard.pk)
    return lines, batch, shard, pipeline


def test_a_checkpoint_lost_from_storage_makes_the_shard_run_whole(
        make_batch, make_pipeline, checkpoint_often, tmp_path):
    # Long enough (about 2 s of engine time) that the first pipeline is still running the
    # shard when it hands it back: with a short shard it may finish it first, and then
    # there is nothing left for the second one to compute.
    lines, batch, shard, first = one_slow_shard(make_batch, make_pipeline, 40, seconds=0.1)
    wait_for(lambda: Shard.objects.get(pk=shard.pk).checkpoint, timeout=20,
             message="a checkpoint")
    first.hand_back_all()
    first.close()
    shard.refresh_from_db()
    for name in Checkpoint.from_json(shard.checkpoint).storage_names():
        default_storage.delete(name)
    log = tmp_path / "requests.log"
    second = make_pipeline(request_log=str(log))
    run_all_shards(second, batch)
    assert len(engine_request_log(log)) == 40  # every line computed by the second run
    done, out, err = finalized(batch)
    assert_exactly_once(out, err, {line["custom_id"] for line in lines})
    assert done.completed == 40 and err == []
    assert json.dumps(done.to_openai()["request_counts"]) == json.dumps(
        {"total": 40, "completed": 40, "failed": 0})


def test_a_running_shard_holds_only_what_its_last_checkpoint_did_not_store(
        make_batch, make_pipeline, checkpoint_often, settings):
    # Results never go to the worker's disk, and what a checkpoint stored leaves memory;
    # the finished part is the segments joined with the rest.
    lines, batch, shard, pipeline = one_slow_shard(make_batch, make_pipeline, 30,
                                                   seconds=0.05)
    wait_for(lambda: len(Checkpoint.from_json(
        Shard.objects.get(pk=shard.pk).checkpoint).segments) >= 2,
        timeout=20, message="two checkpoints")
    work = pipeline.state.works[shard.pk]
    with work.lock:
        released, held, written = work.out.saved, len(work.out.held), work.out.tell()
    assert released > 0 and held == written - released < written
    assert list(Path(settings.TMP_DIR).iterdir()) == []
    wait_for(lambda: Shard.objects.get(pk=shard.pk).status == "done", timeout=30,
             message="the shard done")
    done, out, err = finalized(batch)
    assert_exactly_once(out, err, {line["custom_id"] for line in lines})
    assert len(out) == 30 and err == []
    assert list(Path(settings.TMP_DIR).iterdir()) == []
