"""What of a batch goes to RQ next: a couple of its shards at a time (fair share between
batches; at the front of the queue for a batch the capacity plan marked urgent), then its
finalization once nothing of it is left to run.

Jobs carry ids only and the database says what still has to run, so enqueuing twice is
harmless and a job lost with Redis is re-created by the reconciler.
"""

from __future__ import annotations

from django.db.models import F, Q
from django.utils import timezone

from jobs.lib import queues
from jobs.models import Batch, Shard

# Shards of one batch waiting in Redis at a time. The rest wait in the database, so a small
# batch submitted behind a huge one gets its shards in line after a couple of the huge one's,
# not after all of them: queues interleave batches instead of running them FIFO.
QUEUED_PER_BATCH = 2


def enqueue_next_shards(*, batch_id: str) -> int:
    """Top up the batch's shards waiting in Redis to QUEUED_PER_BATCH. Returns how many
    jobs were created."""
    now = timezone.now()
    # One read (every claim tops up): the running batch's queued shards whose job waits in
    # Redis, then those ready for one, in line.
    line = list(Shard.objects.filter(batch_id=batch_id, status=Shard.Status.QUEUED,
                                     batch__status=Batch.Status.IN_PROGRESS,
                                     batch__stop_code="")
                .filter(Q(enqueued_at__isnull=False) | Q(not_before__isnull=True)
                        | Q(not_before__lte=now))
                .order_by(F("enqueued_at").asc(nulls_last=True), "index")
                .values_list("pk", "queue_name", "enqueued_at", "batch__urgent")
                [:2 * QUEUED_PER_BATCH])
    waiting = sum(1 for _, _, enqueued_at, _ in line if enqueued_at is not None)
    room = QUEUED_PER_BATCH - waiting
    if room <= 0:
        return 0
    created = 0
    for shard_id, queue_name, _, urgent in [row for row in line if row[2] is None][:room]:
        if Shard.objects.filter(pk=shard_id, status=Shard.Status.QUEUED,
                                enqueued_at__isnull=True).update(enqueued_at=now):
            # A batch that would miss its window sharing the workers goes first in line
            # (jobs.capacity.plan): its shards are taken before the others'.
            queues.enqueue_shard(shard_id, queue_name, at_front=urgent)
            created += 1
    return created


def request_finalize(*, batch_id: str) -> None:
    """Enqueue finalization (`services.finalize.finalize_batch`, through the
    `jobs.tasks.finalize_batch` job) if nothing of the batch is left to run."""
    if not Shard.objects.in_line().filter(batch_id=batch_id).exists():
        queues.enqueue_control("jobs.tasks.finalize_batch", batch_id, suffix="finalize")
