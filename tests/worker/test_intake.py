"""The RQ job's side of the worker (`jobs.worker.intake`): a claimed shard's lines go into the
engine's inbox, those validation kept from running get their error lines instead; a shard
not ours to run hands nothing in; a broken engine takes no shard. On a pipeline's own intake,
its threads not started, so what was handed in stays in the inbox to be looked at."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from engine.base import EngineRequest, ModelSpec
from engine.echo import EchoEngine
from jobs.models import Batch, Shard
from jobs.worker.intake import current_intake
from jobs.worker.pipeline import Pipeline
from tests.factories import chat_line


@pytest.fixture
def pipeline() -> Iterator[Pipeline]:
    engine = EchoEngine(ModelSpec(name="echo-test", backend="echo"))
    yield Pipeline(engine, worker_name="w1", inbox_size=8, reconcile_every=0)
    engine.close()


def handed_in(pipeline: Pipeline) -> list[EngineRequest]:
    inbox = pipeline.state.inbox
    return [inbox.get_nowait() for _ in range(inbox.qsize())]


def test_the_rq_job_reaches_the_running_intake_only(pipeline):
    pipeline.intake.start()
    try:
        assert current_intake() is pipeline.intake
    finally:
        pipeline.intake.stop()
    with pytest.raises(RuntimeError, match="batchworker"):
        current_intake()


def test_a_broken_engine_takes_no_shard(pipeline):
    pipeline.state.broken = RuntimeError("the engine core died")
    # Raised before the claim: the shard stays queued for another worker (no database is
    # reached here at all).
    with pytest.raises(RuntimeError, match="engine failed: the engine core died"):
        pipeline.intake.run_shard("any-shard")


@pytest.mark.django_db(transaction=True)
def test_a_shards_lines_are_handed_in_and_refused_ones_answered_at_once(
        pipeline, make_batch: Callable[..., Batch]):
    lines = [chat_line("ok-0", "first"), chat_line("hot", "too hot", temperature=9),
             chat_line("ok-2", "second")]
    batch = make_batch(lines, shard_size=10)
    shard = Shard.objects.get(batch=batch)
    shard_id, first = shard.pk, shard.first_line  # lines are numbered from it
    pipeline.intake.run_shard(shard_id)
    requests = handed_in(pipeline)
    [work] = pipeline.state.current_works()
    assert [r.request_id for r in requests] == [work.request_id(first),
                                                work.request_id(first + 2)]
    assert [r.body["messages"][0]["content"] for r in requests] == ["first", "second"]
    assert set(work.pending) == {r.request_id for r in requests} and work.all_submitted
    # The refused line's error line is written without the engine.
    assert work.answered == {first + 1} and b'"hot"' in bytes(work.err.held)
    shard.refresh_from_db()
    assert shard.status == Shard.Status.RUNNING and shard.worker == "w1"
    assert shard.provenance["engine"] == "echo"  # the engine that serves it, recorded


@pytest.mark.django_db(transaction=True)
def test_a_shard_not_ours_to_run_hands_nothing_in(pipeline, make_batch: Callable[..., Batch]):
    batch = make_batch([chat_line("r0", "hi")], shard_size=10)
    shard_id = Shard.objects.get(batch=batch).pk
    assert pipeline.store.claim(shard_id) is not None  # another worker's claim
    pipeline.intake.run_shard(shard_id)
    assert handed_in(pipeline) == [] and pipeline.state.current_works() == []
