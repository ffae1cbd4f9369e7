"""The periodic repair pass: the database says what should be happening; make Redis and the
workers agree. Safe to run from several processes at once (every change is conditional)."""

from __future__ import annotations

import logging
from datetime import timedelta

from django.db.models import Q
from django.utils import timezone

from jobs.lib import queues
from jobs.models import Batch, Shard
from jobs.services import deadlines
from jobs.services.evals import settle_due
from jobs.services.finalize import FINALIZE_STALE_AFTER
from jobs.services.scheduling import enqueue_next_shards, request_finalize
from jobs.services.shards import fail_shard
from jobs.services.stopping import expire_due_batches
from jobs.services.upkeep import periodic_operations

log = logging.getLogger(__name__)

VALIDATION_GRACE = timedelta(seconds=30)
# Set (with an expiry) by the process that starts a pass: see reconcile_if_due.
PASS_KEY = "batchweb:reconcile-pass"


def reconcile_if_due(*, every: float) -> dict[str, int] | None:
    """Run the pass unless another process of the deployment started one within the last
    `every` seconds; None when skipped. Every worker runs the reconciler so that none is
    needed elsewhere, but one pass per interval repairs everything for all of them (64
    workers each passing every 15 s made four passes a second). The key lives 90% of the
    interval, so a worker alone still passes every interval. Without Redis every worker
    passes (what the database alone says still gets repaired)."""
    import redis

    try:
        due = queues.connection().set(PASS_KEY, "1", nx=True, px=max(1, int(every * 900)))
    except redis.RedisError:
        due = True
    return reconcile() if due else None


def reconcile() -> dict[str, int]:
    """Expire overdue batches, retry shards of dead workers, re-create lost jobs, and
    finalize batches that have nothing left to run. Returns counts of what it did."""
    now = timezone.now()
    done = {"expired": len(expire_due_batches()), "stale": 0, "lost": 0, "validations": 0,
            "finalize": 0, "enqueued": 0}

    for shard_id, attempt in Shard.objects.stale(now).values_list("pk", "attempt"):
        fail_shard(shard_id=shard_id, attempt=attempt, reason="worker lost (no heartbeat)")
        done["stale"] += 1

    # Jobs lost with Redis (restarted without persistence, flushed, evicted).
    for shard_id, queue_name in Shard.objects.filter(
            status=Shard.Status.QUEUED, enqueued_at__lt=now - timedelta(seconds=5)
    ).values_list("pk", "queue_name"):
        if not queues.shard_job_is_queued(shard_id, queue_name):
            Shard.objects.filter(pk=shard_id, status=Shard.Status.QUEUED).update(enqueued_at=None)
            done["lost"] += 1

    for batch_id in Batch.objects.filter(status=Batch.Status.IN_PROGRESS,
                                         stop_code="").values_list("pk", flat=True):
        done["enqueued"] += enqueue_next_shards(batch_id=batch_id)

    for batch_id in Batch.objects.filter(status=Batch.Status.VALIDATING, stop_code="",
                                         created_at__lt=now - VALIDATION_GRACE
                                         ).values_list("pk", flat=True):
        if not queues.job_is_waiting(f"{batch_id}-validate", queues.CONTROL_QUEUE):
            queues.enqueue_control("jobs.tasks.validate_batch", batch_id, suffix="validate")
            done["validations"] += 1

    # Batches with nothing left to run whose finalization was lost or died.
    unfinished = Batch.objects.filter(
        Q(status__in=(Batch.Status.IN_PROGRESS, Batch.Status.CANCELLING))
        | Q(status=Batch.Status.FINALIZING, finalize_claimed_at__lt=now - FINALIZE_STALE_AFTER)
        | Q(status=Batch.Status.VALIDATING) & ~Q(stop_code="")
    ).exclude(pk__in=Shard.objects.in_line().values("batch_id"))
    for batch_id in unfinished.values_list("pk", flat=True):
        if not queues.job_is_waiting(f"{batch_id}-finalize", queues.CONTROL_QUEUE):
            request_finalize(batch_id=batch_id)
            done["finalize"] += 1
    # Eval runs whose batch ended without them being settled (jobs.services.evals).
    done["evals"] = settle_due()
    # The capacity plan: expected ends, batches at risk, which go first in line.
    try:
        deadlines.refresh(now=now)
    except Exception:  # a plan is advice: never stop the repairs for it
        log.exception("could not refresh the capacity plan")
    # Cleanup and webhook retries ride on this pass: no scheduler process is needed.
    done.update(periodic_operations())
    if any(done.values()):
        log.info("reconcile: %s", done)
    return done
