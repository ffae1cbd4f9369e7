"""The checkpointer (`jobs.worker.checkpointer`): when a shard's results are due to be saved,
and a checkpoint itself: what the parts got since the last one stored as a segment and
recorded on the shard row, which the next attempt adopts; an attempt no longer running
records nothing and keeps nothing it stored."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine.base import EngineResult, ModelSpec
from engine.echo import EchoEngine
from jobs.formats.checkpoint_record import Checkpoint
from jobs.formats.prompts import Room
from jobs.formats.wire import RequestLine
from jobs.models import Batch, Shard
from jobs.worker.checkpointer import Checkpointer
from jobs.worker.db import ShardStore
from jobs.worker.state import WorkerState
from jobs.worker.work import ShardWork
from tests.factories import chat_line, storage_snapshot

ENGINE = EchoEngine(ModelSpec(name="echo-test", backend="echo"))


def opened(store: ShardStore, shard_id: str) -> ShardWork:
    """The shard claimed for a new attempt, its work opened, as the intake does."""
    shard = store.claim(shard_id)
    assert shard is not None
    return store.open(shard)


def checkpointer(*, every_requests: int = 3) -> Checkpointer:
    return Checkpointer(WorkerState(ENGINE, inbox_size=4), store=ShardStore(worker="w1"),
                        every_seconds=60, every_requests=every_requests)


def write(work: ShardWork, number: int, line: dict[str, Any]) -> None:
    request = RequestLine(line["custom_id"], line["url"], line["body"])
    status, body = ENGINE.handle(request.url, request.body)
    with work.lock:
        work.write_result(request, number, EngineResult(request_id=work.request_id(number),
                                                        status_code=status, body=body))


def test_it_wakes_once_a_shard_has_enough_unsaved_results():
    saver = checkpointer(every_requests=3)
    saver.timing = True  # it waits for a shard's checkpoint to come due
    saver.notice(2)
    assert not saver.wake.is_set()
    saver.notice(3)
    assert saver.wake.is_set()


def test_it_waits_until_a_shard_is_due_and_a_first_result_wakes_it():
    saver = checkpointer()
    # No shard: nothing to wait for but results no notice announces.
    assert saver._wait() == 60 and not saver.timing
    work = ShardWork(shard_id="s1", attempt=1, batch_id="b", copies={}, skip=set(),
                     screened={}, room=Room(context=None, cap=64), model="echo-test")
    saver.state.register(work)
    assert saver._wait() == 60
    # A first unsaved result wakes a loop that waits with none.
    saver.notice(1)
    assert saver.wake.is_set()
    saver.wake.clear()
    write(work, 0, chat_line("r0", "hi"))
    work.saved_at -= 45
    assert 14 < saver._wait() <= 15 and saver.timing
    saver.notice(1)
    assert not saver.wake.is_set()
    # Due already (its checkpoint put off): looked at again half a second later.
    work.saved_at -= 100
    assert saver._wait() == 0.5


def test_nothing_is_stored_for_a_dropped_attempt_or_one_with_nothing_new(
        settings: Any, tmp_path: Path):
    settings.STORAGES = {**settings.STORAGES, "default": {
        "BACKEND": "django.core.files.storage.FileSystemStorage",
        "OPTIONS": {"location": str(tmp_path)}}}
    saver = checkpointer()
    work = ShardWork(shard_id="s1", attempt=1, batch_id="b", copies={}, skip=set(),
                     screened={}, room=Room(context=None, cap=64), model="echo-test")
    assert saver.save(work)  # nothing unsaved: the row holds everything written
    write(work, 0, chat_line("r0", "hi"))
    work.dead = True
    assert not saver.save(work)
    assert storage_snapshot(tmp_path) == {}


def test_only_the_final_checkpoint_is_taken_while_a_shard_finishes_or_is_handed_back():
    saver = checkpointer()
    for stopping in ("finishing", "handing_back"):
        work = ShardWork(shard_id="s1", attempt=1, batch_id="b", copies={}, skip=set(),
                         screened={}, room=Room(context=None, cap=64), model="echo-test")
        write(work, 0, chat_line("r0", "hi"))
        setattr(work, stopping, True)
        # The finish stores the parts itself; a hand-back takes its own final checkpoint.
        assert not saver.save(work)
        assert work.unsaved_results() == 1


# The checkpoints below are recorded on shard rows by the checkpointer's own thread in a
# worker: the rows must be committed.
@pytest.mark.django_db(transaction=True)
def test_a_checkpoint_is_stored_recorded_and_adopted_by_the_next_attempt(
        make_batch: Callable[..., Batch], storage: Path):
    lines = [chat_line(f"r{i}", f"question {i}") for i in range(4)]
    batch = make_batch(lines, shard_size=10)
    shard_id = Shard.objects.get(batch=batch).pk
    store = ShardStore(worker="w1")
    work = opened(store, shard_id)
    saver = checkpointer()
    saver.state.register(work)
    for number in (0, 1):
        write(work, number, lines[number])
    assert saver.save(work)
    row = Shard.objects.get(pk=shard_id)
    recorded = Checkpoint.from_json(row.checkpoint)
    assert recorded.lines == {0, 1} and recorded.progress.completed == 2
    [segment] = recorded.segments
    assert segment[0] and not segment[1] and not segment[2]  # output lines only
    stored = (storage / segment[0]).read_bytes().splitlines()
    assert [json.loads(text)["custom_id"] for text in stored] == ["r0", "r1"]
    # Saved results leave memory; what comes after goes into the next segment.
    assert work.unsaved_results() == 0 and bytes(work.out.held) == b""
    write(work, 2, lines[2])
    assert saver.save(work)
    assert len(Checkpoint.from_json(Shard.objects.get(pk=shard_id).checkpoint).segments) == 2
    # The worker stops: the next attempt starts from the checkpoint, runs only what is left.
    store.release(work, unsaved=0)
    again = opened(store, shard_id)
    assert again.attempt == work.attempt + 1
    assert again.adopted == {0, 1, 2} and again.progress.completed == 3


@pytest.mark.django_db(transaction=True)
def test_an_attempt_no_longer_running_records_nothing_and_deletes_its_segment(
        make_batch: Callable[..., Batch], storage: Path):
    lines = [chat_line(f"r{i}", f"question {i}") for i in range(2)]
    batch = make_batch(lines, shard_size=10)
    shard_id = Shard.objects.get(batch=batch).pk
    store = ShardStore(worker="w1")
    work = opened(store, shard_id)
    # Presumed dead, its shard handed to another worker's attempt.
    store.release(work, unsaved=0)
    store.claim(shard_id)
    before = storage_snapshot(storage)
    write(work, 0, lines[0])
    assert not checkpointer().save(work)
    assert storage_snapshot(storage) == before
    assert Shard.objects.get(pk=shard_id).checkpoint in ({}, Checkpoint().as_json())
