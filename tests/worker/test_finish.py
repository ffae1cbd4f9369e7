"""A shard's last step on a worker (`jobs.worker.finish`): its parts are stored and it is
recorded done, fenced by its attempt; an attempt that was taken over keeps nothing."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine.base import EngineResult, ModelSpec
from engine.echo import EchoEngine
from jobs.formats.wire import RequestLine
from jobs.models import Batch, Shard
from jobs.worker.db import ShardStore
from jobs.worker.finish import finish
from jobs.worker.state import WorkerState
from jobs.worker.work import ShardWork
from tests.factories import chat_line, storage_snapshot

# The worker's dispatcher finishes shards on its own thread: the rows must be committed.
pytestmark = pytest.mark.django_db(transaction=True)

ENGINE = EchoEngine(ModelSpec(name="echo-test", backend="echo"))


def opened(store: ShardStore, shard_id: str) -> ShardWork:
    """The shard claimed for a new attempt, its work opened, as the intake does."""
    shard = store.claim(shard_id)
    assert shard is not None
    return store.open(shard)


def answered(work: ShardWork, lines: list[dict[str, Any]]) -> None:
    for number, line in enumerate(lines):
        request = RequestLine(line["custom_id"], line["url"], line["body"])
        status, body = ENGINE.handle(request.url, request.body)
        with work.lock:
            work.write_result(request, number, EngineResult(
                request_id=work.request_id(number), status_code=status, body=body))


def test_the_last_result_stores_the_parts_and_records_the_shard_done(
        make_batch: Callable[..., Batch], storage: Path):
    lines = [chat_line(f"r{i}", f"question {i}") for i in range(3)]
    batch = make_batch(lines, shard_size=10)
    shard_id = Shard.objects.get(batch=batch).pk
    store = ShardStore(worker="w1")
    state = WorkerState(ENGINE, inbox_size=4)
    work = opened(store, shard_id)
    state.register(work)
    answered(work, lines)
    finish(state, work, store=store)
    shard = Shard.objects.get(pk=shard_id)
    assert shard.status == Shard.Status.DONE and (shard.completed, shard.failed) == (3, 0)
    stored = (storage / shard.output_part).read_bytes().splitlines()
    assert [json.loads(text)["custom_id"] for text in stored] == ["r0", "r1", "r2"]
    assert not shard.error_part  # nothing failed: no error part
    # The shard leaves this worker, its results with it.
    assert state.current_works() == [] and bytes(work.out.held) == b""


def test_an_attempt_taken_over_keeps_none_of_its_parts(
        make_batch: Callable[..., Batch], storage: Path):
    lines = [chat_line(f"r{i}", f"question {i}") for i in range(2)]
    batch = make_batch(lines, shard_size=10)
    shard_id = Shard.objects.get(batch=batch).pk
    store = ShardStore(worker="w1")
    state = WorkerState(ENGINE, inbox_size=4)
    work = opened(store, shard_id)
    state.register(work)
    answered(work, lines)
    # Another attempt runs the shard now (this worker was presumed dead).
    store.release(work, unsaved=0)
    store.claim(shard_id)
    before = storage_snapshot(storage)
    finish(state, work, store=store)
    assert storage_snapshot(storage) == before
    shard = Shard.objects.get(pk=shard_id)
    assert shard.status == Shard.Status.RUNNING and shard.attempt == work.attempt + 1
    assert not shard.output_part and state.current_works() == []
