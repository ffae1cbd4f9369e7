"""The operator's repairs and routine: put a batch's failed or stuck shards back in line
(the admin's action), and the operations' share of the reconciler's pass. What the queues
and workers are doing (the queue-health page) is read by `jobs.queries.queue_health`."""

from __future__ import annotations

import logging

from jobs.formats.wire import Code
from jobs.models import Batch, Shard
from jobs.services import cleanup, delivery, webhooks
from jobs.services.progress import refresh_progress
from jobs.services.scheduling import enqueue_next_shards
from jobs.services.shards import fail_shard

log = logging.getLogger(__name__)


def requeue_shards(*, batch: Batch) -> int:
    """Run a batch's failed or stuck shards again now (the admin's action): shards waiting
    for a retry or whose job was lost get a job at once, running shards whose worker went
    silent are failed now (and retried) instead of after the heartbeat timeout, and shards
    abandoned after exhausting their retries are queued again with fresh retries. Only for
    a batch still in progress; returns how many shards were put back in line."""
    if batch.status != Batch.Status.IN_PROGRESS or batch.stop_code:
        return 0
    stuck = Shard.objects.stale().filter(batch=batch)
    for shard_id, attempt in stuck.values_list("pk", "attempt"):
        fail_shard(shard_id=shard_id, attempt=attempt, reason="requeued by an operator "
                                                              "(worker silent)")
    # Abandoned with shard_failed (not cancelled or expired) may run again while the batch
    # has not ended: its finalizer has not written their error lines yet. Only while other
    # shards are still in line, so a finalizer cannot be merging the batch right now.
    if Shard.objects.in_line().filter(batch=batch).exists():
        Shard.objects.filter(batch=batch, status=Shard.Status.ABANDONED,
                             end_code=Code.SHARD_FAILED).update(
            status=Shard.Status.QUEUED, failures=0, end_code="", finished_at=None,
            failed=0, not_before=None, enqueued_at=None)
        refresh_progress(batch_id=batch.pk)
    # Waiting for a retry's backoff, or their job was lost: a job now.
    count = Shard.objects.filter(batch=batch, status=Shard.Status.QUEUED).update(
        not_before=None, enqueued_at=None)
    enqueue_next_shards(batch_id=batch.pk)
    return count


def periodic_operations() -> dict[str, int]:
    """The operations' share of the reconciler's pass (every worker, every few seconds):
    enqueue webhook deliveries that are due (retries after backoff, or events whose job was
    lost), result deliveries to an output_prefix that are due, and the cleanup job once per
    interval. They only enqueue control jobs, so the pass stays short; a failure here never
    stops the reconciler's own repairs."""
    done = {"webhooks": 0, "deliveries": 0, "cleanup": 0}
    try:
        done["webhooks"] = webhooks.enqueue_due()
    except Exception:
        log.exception("could not enqueue due webhook deliveries")
    try:
        done["deliveries"] = delivery.enqueue_due()
    except Exception:
        log.exception("could not enqueue due result deliveries")
    try:
        done["cleanup"] = int(cleanup.enqueue_if_due())
    except Exception:
        log.exception("could not schedule the cleanup")
    return done
