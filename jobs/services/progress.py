"""A batch's live counters: the sums of its shards' counters, copied onto its row so that
what clients poll (`GET /v1/batches`, the batch page) reads one row however many shards a
batch has. The shards stay the truth."""

from __future__ import annotations

from django.db import transaction
from django.db.models import OuterRef, Subquery, Sum
from django.db.models.functions import Coalesce

from jobs.models import PROGRESS_FIELDS, Batch, Shard


def refresh_progress(*, batch_id: str) -> None:
    """Copy the sums of the batch's shard counters onto its row (Batch.completed and the
    rest). Called after every change to a shard's counters; the shards stay the truth.

    The batch row is locked first, so that of two workers refreshing at once the later sum
    is written last (PostgreSQL: the UPDATE then sees every shard write committed before
    the lock was granted; SQLite's IMMEDIATE transactions run one writer at a time)."""
    shards = Shard.objects.filter(batch=OuterRef("pk")).order_by().values("batch")
    with transaction.atomic():
        locked = Batch.objects.select_for_update().filter(pk=batch_id)
        if not locked.values_list("pk", flat=True):
            return
        locked.update(**{k: Coalesce(Subquery(shards.annotate(total=Sum(k)).values("total")), 0)
                         for k in PROGRESS_FIELDS})
