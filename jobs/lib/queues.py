"""Redis queues: only a transport that wakes workers up. Jobs carry ids, never user data;
the database says what still has to run, so a lost job is re-created by the reconciler."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import django_rq
from django.conf import settings
from rq import Queue
from rq.job import Job

# Validation and finalization: short jobs every worker takes before any shard.
CONTROL_QUEUE = "batchweb"
# Webhook deliveries: calls to users' servers, which may be slow (up to
# WEBHOOK_TIMEOUT_SECONDS each). Never on the control queue, so a user's slow receiver
# cannot hold back the validation or finalization of anyone's batch; every batchworker
# takes this queue after its control and shard queues.
WEBHOOK_QUEUE = "batchweb.webhooks"
PRIORITIES = ("high", "default", "low")


# One client per process and Redis configuration, shared by its threads (a redis-py client
# is a thread-safe connection pool; it reconnects after a fork and retries a dropped
# connection): django_rq builds a new client, so a new connection, at every call, and a
# worker enqueues a shard with every claim.
_clients: dict[str, Any] = {}


def connection() -> Any:
    from django_rq.settings import QUEUES

    key = repr(sorted(QUEUES[CONTROL_QUEUE].items()))
    client = _clients.get(key)
    if client is None:
        client = _clients[key] = django_rq.get_connection(CONTROL_QUEUE)
    return client


def queue(name: str) -> Queue:
    return Queue(name, connection=connection())


def shard_queue_name(model: str, priority: str) -> str:
    return f"{model}.{priority}"


def model_queue_names(model: str) -> list[str]:
    """A model's queues in the order its workers take them."""
    return [shard_queue_name(model, p) for p in PRIORITIES]


def enqueue_control(func: str, batch_id: str, *, suffix: str) -> None:
    # A fixed job id per batch and step: enqueuing twice replaces, never doubles, the job.
    queue(CONTROL_QUEUE).enqueue(func, batch_id, job_id=f"{batch_id}-{suffix}",
                                 job_timeout=settings.BATCHWEB["CONTROL_JOB_TIMEOUT"],
                                 result_ttl=600, failure_ttl=7 * 24 * 3600)


def enqueue_shard(shard_id: str, queue_name: str, *, at_front: bool = False) -> None:
    # A shard runs as long as it runs: the worker heartbeats in the database instead.
    queue(queue_name).enqueue("jobs.tasks.run_shard", shard_id, job_id=shard_id,
                              job_timeout=-1, result_ttl=600, failure_ttl=7 * 24 * 3600,
                              at_front=at_front)


def move_to_front(shard_id: str, queue_name: str) -> bool:
    """Put a shard's waiting job at the head of its queue (workers pop from the left);
    False when it no longer waits there (a worker took it meanwhile: nothing to move)."""
    client = connection()
    key = queue(queue_name).key
    if not client.lrem(key, 0, shard_id):
        return False
    client.lpush(key, shard_id)
    return True


def job_is_waiting(job_id: str, queue_name: str, *,
                   started_within: timedelta = timedelta(minutes=10)) -> bool:
    """Whether the job still sits in its queue, or a worker started it recently. A job
    popped by a worker that died (SIGKILL) stays "started" in RQ's eyes until RQ's own
    cleanup, minutes later; past `started_within` the reconciler treats it as lost (the
    control jobs it re-creates are idempotent)."""
    if queue(queue_name).get_job_position(job_id) is not None:
        return True
    try:
        job = Job.fetch(job_id, connection=connection())
    except Exception:
        return False
    if job.get_status(refresh=False) != "started":
        return False
    started_at = job.started_at
    if started_at is None:
        return True
    if started_at.tzinfo is None:
        started_at = started_at.replace(tzinfo=UTC)
    return datetime.now(UTC) - started_at < started_within


def shard_job_is_queued(shard_id: str, queue_name: str) -> bool:
    """Whether a queued shard's job is still in its queue. A shard still queued while its
    job is started was popped by a worker that died before claiming it: lost too."""
    return queue(queue_name).get_job_position(shard_id) is not None
