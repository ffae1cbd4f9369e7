"""In-process pipeline tests: a `Pipeline` with the echo engine on the test database, shards
handed to it the way the RQ job does (`run_shard`), without worker subprocesses."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

from engine.base import ModelSpec
from engine.echo import EchoEngine
from jobs.models import Batch, Shard
from jobs.services.batches import create_batch
from jobs.services.files import create_input_file, open_file
from jobs.services.finalize import finalize_batch
from jobs.services.validation import run_validation
from jobs.worker.pipeline import Pipeline
from tests.helpers import jsonl, wait_for
from tests.reliability_support import use_private_storage


@pytest.fixture
def storage(settings: Any, tmp_path: Path) -> Path:
    return use_private_storage(settings, tmp_path)


@pytest.fixture
def make_batch(user: Any, tmp_path: Path, settings: Any, storage: Path
               ) -> Callable[..., Batch]:
    def make(lines: list[dict], *, shard_size: int = 4) -> Batch:
        settings.BATCHWEB = {**settings.BATCHWEB, "SHARD_SIZE": shard_size}
        path = tmp_path / "in.jsonl"
        path.write_bytes(jsonl(lines))
        file = create_input_file(owner=user, path=path, filename="in.jsonl", purpose="batch")
        created = create_batch(owner=user, input_file_id=file.pk,
                               endpoint="/v1/chat/completions", completion_window="24h")
        run_validation(batch_id=created.pk)
        batch = Batch.objects.get(pk=created.pk)
        assert batch.status == "in_progress", batch.errors
        return batch
    return make


@pytest.fixture
def make_pipeline() -> Iterator[Callable[..., Pipeline]]:
    """A started pipeline on an echo engine (options as EchoEngine takes them); closed at
    the end of the test. The reconciler is off: the test drives every transition."""
    started: list[Pipeline] = []

    def make(*, inbox_size: int = 64, **options: Any) -> Pipeline:
        engine = EchoEngine(ModelSpec(name="echo-test", backend="echo", options=options))
        pipeline = Pipeline(engine, worker_name="test-worker", inbox_size=inbox_size,
                            reconcile_every=0)
        pipeline.start()
        started.append(pipeline)
        return pipeline

    yield make
    for pipeline in started:
        pipeline.close()


def start_shard(pipeline: Pipeline, shard_id: str) -> threading.Thread:
    """Run the RQ job's side in a thread of its own, as `batchworker` runs it in its main
    thread: it returns only once the engine's batch has room, which a slow engine delays."""
    def job() -> None:
        try:
            pipeline.run_shard(shard_id)
        finally:
            connection.close()

    thread = threading.Thread(target=job, name=f"job-{shard_id}", daemon=True)
    thread.start()
    return thread


def run_all_shards(pipeline: Pipeline, batch: Batch, *, timeout: float = 30) -> None:
    for shard_id in Shard.objects.filter(batch=batch).order_by("index").values_list(
            "pk", flat=True):
        pipeline.run_shard(shard_id)
    wait_for(lambda: not Shard.objects.filter(batch=batch).exclude(status="done").exists(),
             timeout=timeout, message="every shard done")


def finalized(batch: Batch) -> tuple[Batch, list[dict], list[dict]]:
    """Finalize the batch; (batch, output lines, error lines), every custom_id at most once."""
    done = finalize_batch(batch_id=batch.pk)
    assert done is not None
    found = []
    for file in (done.output_file, done.error_file):
        lines = []
        if file is not None:
            with open_file(file) as stream:
                lines = [json.loads(line) for line in stream]
        found.append(lines)
    ids = [r["custom_id"] for r in found[0] + found[1]]
    assert len(ids) == len(set(ids)), "a custom_id appears twice"
    return done, found[0], found[1]
