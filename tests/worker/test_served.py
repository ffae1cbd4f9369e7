"""What a worker records of what it serves (`jobs.worker.served`): the engine's provenance,
read once, on each shard it claims and on the shard's batch; and the LoRA adapters a shard's
lines name, each resolved once per attempt. On a pipeline's own `Served`, its threads not
started."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from engine.base import ModelSpec
from engine.echo import EchoEngine
from jobs.lib import release
from jobs.models import Batch, Shard
from jobs.worker.pipeline import Pipeline
from jobs.worker.served import Served
from tests.factories import chat_line


@pytest.fixture
def pipeline() -> Iterator[Pipeline]:
    engine = EchoEngine(ModelSpec(name="echo-test", backend="echo"))
    yield Pipeline(engine, worker_name="w1", inbox_size=8, reconcile_every=0)
    engine.close()


def served_of(pipeline: Pipeline) -> Served:
    return pipeline.intake.served


def test_the_engines_record_is_read_once(pipeline):
    served = served_of(pipeline)
    record = served.record()
    # The engine's record, and the release that ran it (added by the worker).
    assert record == {**pipeline.state.engine.provenance(),
                      "batchweb_version": release.version()} and record["engine"] == "echo"
    assert served.record() is record


@pytest.mark.django_db(transaction=True)
def test_a_claim_records_the_engine_on_the_shard_and_its_batch(
        pipeline, make_batch: Callable[..., Batch]):
    batch = make_batch([chat_line("r0", "hi")], shard_size=10)
    shard = pipeline.store.claim(Shard.objects.get(batch=batch).pk)
    assert shard is not None
    served_of(pipeline).claimed(shard)
    recorded = Shard.objects.get(pk=shard.pk).provenance
    assert recorded["worker"] == "w1" and recorded["adapters"] == []
    assert recorded["model_sha256"] == served_of(pipeline).record()["model_sha256"]
    assert "w1" in str(Batch.objects.get(pk=batch.pk).provenance)


@pytest.mark.django_db(transaction=True)
def test_an_adapter_is_resolved_once_per_attempt(pipeline, make_batch: Callable[..., Batch]):
    batch = make_batch([chat_line("r0", "hi")], shard_size=10)
    shard = pipeline.store.claim(Shard.objects.get(batch=batch).pk)
    assert shard is not None
    work = pipeline.store.open(shard)
    served = served_of(pipeline)
    # The batch's own model needs no adapter.
    assert served.adapter_folder(shard, work, "echo-test") == ""
    # One no longer registered: resolved to None once, kept on the attempt's work.
    assert served.adapter_folder(shard, work, "gone-lora") is None
    assert work.adapter_paths == {"gone-lora": None}
    assert served.adapter_folder(shard, work, "gone-lora") is None
