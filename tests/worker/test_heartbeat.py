"""The heartbeat (`jobs.worker.heartbeat`): each beat keeps this worker's shards alive with
their progress, drops a shard whose attempt is no longer the running one, and stops the
requests of a shard whose batch was cancelled; all of the worker's shards in one
transaction, each batch's sums refreshed and its stop code read once. On a pipeline's own
heartbeat (its thread not started: the test beats), on the test database."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from engine.base import ModelSpec
from engine.echo import EchoEngine
from jobs.formats.wire import Code, RequestLine
from jobs.models import Batch, Shard
from jobs.services.stopping import cancel_batch
from jobs.worker.pipeline import Pipeline
from jobs.worker.work import ShardWork
from tests.factories import chat_lines

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def pipeline() -> Iterator[Pipeline]:
    engine = EchoEngine(ModelSpec(name="echo-test", backend="echo"))
    yield Pipeline(engine, worker_name="w1", inbox_size=4, reconcile_every=0)
    engine.close()


def running(pipeline: Pipeline, batch: Batch, index: int = 0) -> ShardWork:
    shard = pipeline.store.claim(Shard.objects.get(batch=batch, index=index).pk)
    assert shard is not None
    work = pipeline.store.open(shard)
    pipeline.state.register(work)
    return work


def test_a_beat_records_the_shards_progress(pipeline, make_batch: Callable[..., Batch]):
    work = running(pipeline, make_batch(chat_lines(3), shard_size=10))
    before = Shard.objects.get(pk=work.shard_id).heartbeat_at
    with work.lock:
        work.progress.completed = 2
        work.progress.input_tokens = 17
    pipeline.heartbeat.beat()
    shard = Shard.objects.get(pk=work.shard_id)
    assert (shard.completed, shard.input_tokens) == (2, 17)
    assert shard.heartbeat_at is not None and (before is None or shard.heartbeat_at > before)
    assert pipeline.state.current_works() == [work] and not work.dead


def test_a_shard_taken_over_is_dropped(pipeline, make_batch: Callable[..., Batch]):
    work = running(pipeline, make_batch(chat_lines(2), shard_size=10))
    work.out.write(b"a result of the lost attempt\n")
    # Presumed dead meanwhile: its shard runs under another attempt now.
    pipeline.store.release(work, unsaved=0)
    pipeline.store.claim(work.shard_id)
    pipeline.heartbeat.beat()
    assert work.dead and pipeline.state.current_works() == []
    assert bytes(work.out.held) == b""
    # The other attempt's row is left as it is.
    assert Shard.objects.get(pk=work.shard_id).attempt == work.attempt + 1


def test_a_cancelled_batchs_shard_stops_its_requests(pipeline,
                                                     make_batch: Callable[..., Batch]):
    batch = make_batch(chat_lines(2), shard_size=10)
    work = running(pipeline, batch)
    work.pending[work.request_id(0)] = RequestLine("r0", "/v1/chat/completions", {})
    cancel_batch(batch=batch)
    pipeline.heartbeat.beat()
    assert work.stop_code == Code.BATCH_CANCELLED
    # Still this worker's, to write its lines' error lines and finish.
    assert not work.dead and pipeline.state.current_works() == [work]


def test_a_beat_with_nothing_new_leaves_the_batchs_sums_alone(
        pipeline, make_batch: Callable[..., Batch]):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    batch = make_batch(chat_lines(3), shard_size=10)
    work = running(pipeline, batch)
    with work.lock:
        work.progress.completed = 1
    pipeline.heartbeat.beat()
    assert Batch.objects.get(pk=batch.pk).completed == 1
    with CaptureQueriesContext(connection) as moved_not:
        pipeline.heartbeat.beat()
    # Kept alive all the same, without the batch's sums read again.
    assert not any("SUM(" in q["sql"].upper() for q in moved_not.captured_queries)
    assert any("heartbeat_at" in q["sql"] for q in moved_not.captured_queries)
    with work.lock:
        work.progress.completed = 2
    with CaptureQueriesContext(connection) as moved:
        pipeline.heartbeat.beat()
    assert any("SUM(" in q["sql"].upper() for q in moved.captured_queries)
    assert Batch.objects.get(pk=batch.pk).completed == 2


def test_a_batchs_shards_beat_together(pipeline, make_batch: Callable[..., Batch]):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    batch = make_batch(chat_lines(9), shard_size=3)
    works = [running(pipeline, batch, index) for index in range(3)]
    for work in works:
        with work.lock:
            work.progress.completed = 1
    pipeline.heartbeat.beat()
    assert Batch.objects.get(pk=batch.pk).completed == 3
    with works[0].lock:
        works[0].progress.completed = 2
    cancel_batch(batch=batch)
    with CaptureQueriesContext(connection) as beat:
        pipeline.heartbeat.beat()
    sql = [q["sql"] for q in beat.captured_queries]
    # Each shard's row, the batch's sums once (one shard moved), its stop code once.
    assert sum(s.startswith("UPDATE") and "heartbeat_at" in s for s in sql) == 3
    assert sum("SUM(" in s.upper() for s in sql) == 1
    assert sum("stop_code" in s and s.startswith("SELECT") for s in sql) == 1
    assert Batch.objects.get(pk=batch.pk).completed == 4
    assert [work.stop_code for work in works] == [Code.BATCH_CANCELLED] * 3
    assert {shard.heartbeat_at for shard in Shard.objects.filter(batch=batch)} == {
        Shard.objects.filter(batch=batch).first().heartbeat_at}
