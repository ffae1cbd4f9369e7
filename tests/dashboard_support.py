"""Helpers for the dashboard tests: batches brought to any state without worker processes,
by the same service calls the workers make (validation, shard parts, finalization)."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from django.core.files.base import ContentFile
from django.core.files.storage import default_storage
from django.utils import timezone

from jobs.models import Batch, File, Shard
from jobs.services.batches import create_batch
from jobs.services.files import create_input_file, new_storage_name
from jobs.services.finalize import finalize_batch
from jobs.services.progress import refresh_progress
from jobs.services.shard_input import shard_custom_ids
from jobs.services.validation import run_validation
from jobs.wire import response_line
from tests.helpers import jsonl


def make_file(owner: Any, lines: list[dict] | list[str], tmp_path: Path,
              name: str = "in.jsonl") -> File:
    path = tmp_path / f"upload-{len(list(tmp_path.iterdir()))}.jsonl"
    path.write_bytes(jsonl(lines))
    return create_input_file(owner=owner, path=path, filename=name, purpose="batch")


def make_batch(owner: Any, lines: list[dict], tmp_path: Path, *, shard_size: int = 1000,
               settings: Any = None, **extra: Any) -> Batch:
    """A validated, running batch (shards planned, none run)."""
    if settings is not None:
        settings.BATCHWEB = {**settings.BATCHWEB, "SHARD_SIZE": shard_size}
    file = make_file(owner, lines, tmp_path)
    batch = create_batch(owner=owner, input_file_id=file.pk, endpoint="/v1/chat/completions",
                         completion_window="24h", **extra)
    run_validation(batch_id=batch.pk)
    return Batch.objects.get(pk=batch.pk)


def chat_body(custom_id: str, text: str) -> dict[str, Any]:
    return {"id": f"chatcmpl-{custom_id[:20]}", "object": "chat.completion",
            "model": "echo-test",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}


def run_shard(shard: Shard, *, fails: Callable[[str], bool] = lambda c: False,
              answer: Callable[[str], str] = lambda c: f"echo: {c}",
              started: datetime | None = None, seconds: float = 10) -> None:
    """Do what a worker does for one shard: write its parts and record it done."""
    out = io.BytesIO()
    err = io.BytesIO()
    completed = failed = 0
    for custom_id in shard_custom_ids(shard):
        if fails(custom_id):
            err.write(response_line(custom_id, 400, {"error": {
                "message": "This model's maximum context length is 2048 tokens.",
                "type": "BadRequestError", "param": None, "code": 400}}))
            failed += 1
        else:
            out.write(response_line(custom_id, 200, chat_body(custom_id, answer(custom_id))))
            completed += 1
    names = {}
    for kind, buffer in (("out", out), ("err", err)):
        data = buffer.getvalue()
        names[kind] = default_storage.save(new_storage_name(f"parts/{shard.batch_id}"),
                                           ContentFile(data)) if data else ""
    started = started or timezone.now() - timedelta(seconds=seconds)
    Shard.objects.filter(pk=shard.pk).update(
        status=Shard.Status.DONE, attempt=shard.attempt + 1, started_at=started,
        finished_at=started + timedelta(seconds=seconds), completed=completed, failed=failed,
        input_tokens=5 * completed, output_tokens=3 * completed, output_part=names["out"],
        error_part=names["err"], worker="test")
    refresh_progress(batch_id=shard.batch_id)


def run_batch(batch: Batch, *, only: int | None = None, **kwargs: Any) -> Batch:
    """Run every shard (or the first `only`), then finalize when all ran."""
    shards = list(Shard.objects.filter(batch=batch).exclude(status=Shard.Status.DONE)
                  .order_by("index"))
    for shard in shards[:only]:
        run_shard(shard, **kwargs)
    if only is None or only >= len(shards):
        finalize_batch(batch_id=batch.pk)
    return Batch.objects.get(pk=batch.pk)


def lines_of(owner: Any, file_id: str) -> list[dict]:
    file = File.objects.get(pk=file_id, owner=owner)
    with default_storage.open(file.storage_name, "rb") as handle:
        return [json.loads(line) for line in handle.read().splitlines() if line.strip()]




