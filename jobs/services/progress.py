"""A batch's live counters: the sums of its shards' counters, copied onto its row so that
what clients poll (`GET /v1/batches`, the batch page) reads one row however many shards a
batch has. The shards stay the truth."""

from __future__ import annotations

import hashlib

from django.db import transaction
from django.db.models import F, Sum
from django.db.models.functions import Coalesce

from jobs.models import PROGRESS_FIELDS, Batch, Shard


def refresh_progress(*, batch_id: str) -> None:
    """Copy the sums of the batch's shard counters onto its row (Batch.completed and the
    rest). Called after every change to a shard's counters; the shards stay the truth.
    When the sums are what the row holds already (a heartbeat with nothing new finished),
    the row is not written: what a poll of the batch shows has not changed, and its
    version must not either.

    The batch row is locked first, so that of two workers refreshing at once the later sum
    is written last (PostgreSQL: the sums read after the lock is granted see every shard
    write committed before it; SQLite's IMMEDIATE transactions run one writer at a time)."""
    # Part of the caller's transaction when there is one (it is then undone with it): no
    # savepoint, two round trips less on every heartbeat and finish.
    with transaction.atomic(savepoint=False):
        locked = Batch.objects.select_for_update().filter(pk=batch_id)
        held = locked.values_list(*PROGRESS_FIELDS).first()
        if held is None:
            return
        sums = Shard.objects.filter(batch_id=batch_id).order_by().aggregate(
            **{k: Coalesce(Sum(k), 0) for k in PROGRESS_FIELDS})
        if tuple(sums[k] for k in PROGRESS_FIELDS) != tuple(held):
            locked.update(progress_version=F("progress_version") + 1, **sums)


# What a poll shows of the batch row that changes without a progress write: a status move
# and its timestamp, the files the finalizer writes, a stop being asked, an eval run's
# drift (scored once the batch has ended), the delivery of its results to its owner's
# bucket (done or failed after it ended), what ran it (a worker's first claim), its
# results archived.
_SHOWN_WITHOUT_PROGRESS = (
    "status", "stop_code", "total", "dedup_saved", "model", "output_file_id", "error_file_id",
    "in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
    "cancelling_at", "cancelled_at", "eval_drift", "delivery_status", "delivery_attempts",
    "delivery_next_at", "provenance", "archived_at")


def batch_version(batch: Batch, *extra: object) -> str:
    """A strong validator of what a poll of `batch` shows: its progress_version (bumped by
    every progress write) with the row's other shown fields and whatever else the caller's
    answer depends on (`extra`). Equal versions mean an unchanged answer."""
    parts = [batch.pk, batch.progress_version, len(batch.errors or ()), *extra,
             *(getattr(batch, name) for name in _SHOWN_WITHOUT_PROGRESS)]
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]
