"""What the queues and workers are doing, read from Redis and the database at the moment
of asking: the admin's queue-health page and the /metrics endpoint share it. Plus the
operator's repair for a batch's failed or stuck shards."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import Count, F, Q
from django.utils import timezone
from rq import Worker

from jobs import queues
from jobs.models import Batch, Shard
from jobs.services import cleanup, webhooks
from jobs.services.progress import refresh_progress
from jobs.services.scheduling import enqueue_next_shards
from jobs.services.shards import fail_shard
from jobs.wire import Code

log = logging.getLogger(__name__)


@dataclass
class WorkerInfo:
    name: str
    state: str
    queues: list[str]
    last_heartbeat: datetime | None
    current_job: str | None


@dataclass
class RunningShard:
    id: str
    batch_id: str
    index: int
    worker: str
    attempt: int
    age: timedelta
    heartbeat_age: timedelta | None
    stuck: bool


@dataclass
class ModelHealth:
    model: str
    depth: dict[str, int]  # priority -> jobs waiting in Redis
    workers: list[WorkerInfo] = field(default_factory=list)
    running: list[RunningShard] = field(default_factory=list)
    waiting_in_db: int = 0  # queued shards without a job (fair share, backoff)

    @property
    def stuck(self) -> list[RunningShard]:
        return [s for s in self.running if s.stuck]


@dataclass
class Health:
    models: list[ModelHealth]
    control_depth: int
    control_workers: int
    redis_ok: bool = True
    redis_error: str = ""


def _workers(connection: Any) -> list[Any]:
    return Worker.all(connection=connection)


def _info(worker: Any) -> WorkerInfo:
    job_id = worker.get_current_job_id()
    return WorkerInfo(name=worker.name, state=str(worker.get_state()),
                      queues=worker.queue_names(), last_heartbeat=worker.last_heartbeat,
                      current_job=job_id)


def queue_health(*, now: datetime | None = None) -> Health:
    now = now or timezone.now()
    stale_before = now - timedelta(seconds=settings.BATCHWEB["HEARTBEAT_TIMEOUT_SECONDS"])
    names = [m["name"] for m in settings.BATCHWEB_MODELS]
    models = {name: ModelHealth(model=name, depth={}) for name in names}
    redis_ok, redis_error, control_depth, control_workers = True, "", 0, 0
    try:
        connection = queues.connection()
        workers = _workers(connection)
        control_depth = queues.queue(queues.CONTROL_QUEUE).count
        control_workers = sum(1 for w in workers if queues.CONTROL_QUEUE in w.queue_names())
        for name, health in models.items():
            for priority, queue_name in zip(queues.PRIORITIES, queues.model_queue_names(name),
                                            strict=True):
                health.depth[priority] = queues.queue(queue_name).count
            own = set(queues.model_queue_names(name))
            health.workers = [_info(w) for w in workers if own & set(w.queue_names())]
    except Exception as exc:  # Redis down: the database half of the page still helps
        redis_ok, redis_error = False, f"{type(exc).__name__}: {exc}"
    running = Shard.objects.filter(status=Shard.Status.RUNNING).select_related("batch").only(
        "id", "batch_id", "index", "worker", "attempt", "started_at", "heartbeat_at",
        "batch__model").order_by("started_at")
    for shard in running:
        health = models.setdefault(shard.batch.model,
                                   ModelHealth(model=shard.batch.model, depth={}))
        health.running.append(RunningShard(
            id=shard.pk, batch_id=shard.batch_id, index=shard.index, worker=shard.worker,
            attempt=shard.attempt, age=now - (shard.started_at or now),
            heartbeat_age=(now - shard.heartbeat_at) if shard.heartbeat_at else None,
            stuck=shard.heartbeat_at is None or shard.heartbeat_at < stale_before))
    for row in Shard.objects.filter(status=Shard.Status.QUEUED, enqueued_at__isnull=True
                                    ).values("batch__model").annotate(n=Count("id")):
        model = row["batch__model"]
        models.setdefault(model, ModelHealth(model=model, depth={})).waiting_in_db = row["n"]
    return Health(models=list(models.values()), control_depth=control_depth,
                  control_workers=control_workers, redis_ok=redis_ok, redis_error=redis_error)


def requeue_shards(*, batch: Batch) -> int:
    """Run a batch's failed or stuck shards again now (the admin's action): shards waiting
    for a retry or whose job was lost get a job at once, running shards whose worker went
    silent are failed now (and retried) instead of after the heartbeat timeout, and shards
    abandoned after exhausting their retries are queued again with fresh retries. Only for
    a batch still in progress; returns how many shards were put back in line."""
    if batch.status != Batch.Status.IN_PROGRESS or batch.stop_code:
        return 0
    stale_before = timezone.now() - timedelta(
        seconds=settings.BATCHWEB["HEARTBEAT_TIMEOUT_SECONDS"])
    stuck = Shard.objects.filter(batch=batch, status=Shard.Status.RUNNING).filter(
        Q(heartbeat_at__lt=stale_before) | Q(heartbeat_at__isnull=True))
    for shard_id, attempt in stuck.values_list("pk", "attempt"):
        fail_shard(shard_id=shard_id, attempt=attempt, reason="requeued by an operator "
                                                              "(worker silent)")
    # Abandoned with shard_failed (not cancelled or expired) may run again while the batch
    # has not ended: its finalizer has not written their error lines yet. Only while other
    # shards are still in line, so a finalizer cannot be merging the batch right now.
    if Shard.objects.filter(batch=batch, status__in=(Shard.Status.QUEUED,
                                                     Shard.Status.RUNNING)).exists():
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


def shard_counts_by_model() -> dict[tuple[str, str], int]:
    """(model, status) -> shards, for queued and running shards."""
    rows = Shard.objects.filter(status__in=(Shard.Status.QUEUED, Shard.Status.RUNNING)).values(
        model=F("batch__model"), st=F("status")).annotate(n=Count("id"))
    return {(r["model"], r["st"]): r["n"] for r in rows}


def periodic_operations() -> dict[str, int]:
    """The operations' share of the reconciler's pass (every worker, every few seconds):
    enqueue webhook deliveries that are due (retries after backoff, or events whose job was
    lost) and the cleanup job once per interval. Both only enqueue control jobs, so the
    pass stays short; a failure here never stops the reconciler's own repairs."""
    done = {"webhooks": 0, "cleanup": 0}
    try:
        done["webhooks"] = webhooks.enqueue_due()
    except Exception:
        log.exception("could not enqueue due webhook deliveries")
    try:
        done["cleanup"] = int(cleanup.enqueue_if_due())
    except Exception:
        log.exception("could not schedule the cleanup")
    return done
