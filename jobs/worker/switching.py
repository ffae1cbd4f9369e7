"""Several models on one worker: which model to switch to, and when.

A host with one GPU may run one worker for several models (`batchworker --model A --model
B`). It keeps one engine loaded and takes only that model's queues; once they are empty
and nothing of the model is in flight, it switches to the model whose shards have waited
longest, if they have waited MODEL_SWITCH_SECONDS. Waiting is read from the database
(a shard's `enqueued_at` is when its job went into Redis), the truth of what runs next.
"""

from __future__ import annotations

from datetime import timedelta

from django.utils import timezone

from engine.base import ModelSpec
from jobs.worker.db import ShardStore


def model_due(others: list[ModelSpec], *, waited_seconds: float, store: ShardStore
              ) -> ModelSpec | None:
    """Among `others`, the model whose oldest shard waiting in Redis went in first, if it
    went in at least `waited_seconds` ago; else None."""
    cutoff = timezone.now() - timedelta(seconds=waited_seconds)
    oldest = None
    due = None
    for spec in others:
        since = store.queued_since(spec.name, before=cutoff)
        if since is not None and (oldest is None or since < oldest):
            oldest, due = since, spec
    return due
