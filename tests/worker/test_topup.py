"""The top-up thread (`jobs.worker.topup`): after a claim, the claimed shard's batch gets its
next shards into Redis, off the claim's path; requests made meanwhile are served together,
and the thread ends when joined."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from jobs.lib import queues
from jobs.models import Batch, Shard
from jobs.services.scheduling import QUEUED_PER_BATCH
from jobs.worker.db import ShardStore
from jobs.worker.topup import TopUp
from tests.factories import chat_lines, wait_for

# The top-up runs on a thread of its own, with its own connection: rows must be committed.
pytestmark = pytest.mark.django_db(transaction=True)


def in_redis(batch: Batch) -> set[str]:
    return {job_id for name in queues.model_queue_names(batch.model)
            for job_id in queues.queue(name).job_ids}


def test_a_claimed_shards_batch_gets_its_next_shards_into_redis(
        make_batch: Callable[..., Batch]):
    batch = make_batch(chat_lines(10), shard_size=2)  # five shards
    shards = list(Shard.objects.filter(batch=batch).order_by("index").values_list(
        "pk", flat=True))
    # Validation puts the first shards in Redis, no more than a batch may have waiting.
    assert in_redis(batch) == set(shards[:QUEUED_PER_BATCH])
    # Two claims, as a worker makes them (the claim itself tops nothing up).
    store = ShardStore(worker="w1")
    for shard_id in shards[:2]:
        assert store.claim(shard_id) is not None
    top_up = TopUp()
    top_up.request(batch.pk)
    top_up.request(batch.pk)
    top_up.start()
    try:
        wait_for(lambda: len(in_redis(batch) - set(shards[:2])) == QUEUED_PER_BATCH,
                 timeout=10, message="the next shards in Redis")
    finally:
        top_up.join(timeout=10)
    assert not top_up.thread.is_alive()
    assert in_redis(batch) - set(shards[:2]) == set(shards[2:2 + QUEUED_PER_BATCH])
    waiting = Shard.objects.filter(batch=batch, enqueued_at__isnull=False,
                                   status=Shard.Status.QUEUED)
    assert set(waiting.values_list("pk", flat=True)) == set(shards[2:2 + QUEUED_PER_BATCH])


def test_requests_made_while_it_runs_are_served_in_turn(
        make_batch: Callable[..., Batch]):
    batch = make_batch(chat_lines(6), shard_size=2)
    shards = list(Shard.objects.filter(batch=batch).order_by("index").values_list(
        "pk", flat=True))
    store = ShardStore(worker="w1")
    assert store.claim(shards[0]) is not None
    top_up = TopUp()
    top_up.start()
    try:
        # A batch that is gone by now has nothing to top up; the next one is served.
        top_up.request("batch_that_is_not_there")
        top_up.request(batch.pk)
        wait_for(lambda: shards[2] in in_redis(batch), timeout=10,
                 message="the third shard in Redis")
    finally:
        top_up.join(timeout=10)
    assert not top_up.thread.is_alive()
