"""In-process pipeline tests: a `Pipeline` with the echo engine on the test database, shards
handed to it the way the RQ job does (`run_shard`), without worker subprocesses."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.base import ModelSpec
from engine.echo import EchoEngine
from jobs.models import Batch
from jobs.services.batches import create_batch
from jobs.services.files import create_input_file
from jobs.services.validation import run_validation
from jobs.worker.pipeline import Pipeline
from tests.factories import jsonl, use_private_storage


@pytest.fixture
def storage(settings: Any, tmp_path: Path) -> Path:
    return use_private_storage(settings, tmp_path)


@pytest.fixture
def make_batch(user: Any, tmp_path: Path, settings: Any, storage: Path
               ) -> Callable[..., Batch]:
    def make(lines: list[dict], *, shard_size: int = 4,
             endpoint: str = "/v1/chat/completions") -> Batch:
        settings.BATCHWEB = {**settings.BATCHWEB, "SHARD_SIZE": shard_size}
        path = tmp_path / "in.jsonl"
        path.write_bytes(jsonl(lines))
        file = create_input_file(owner=user, path=path, filename="in.jsonl", purpose="batch")
        created = create_batch(owner=user, input_file_id=file.pk,
                               endpoint=endpoint, completion_window="24h")
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
