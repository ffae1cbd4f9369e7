"""What the queues and workers are doing, read from Redis and the database at the moment
of asking: the admin's queue-health page and the /metrics endpoint share it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db.models import Count, F
from django.utils import timezone
from rq import Worker

from jobs import queues
from jobs.engines import model_names
from jobs.models import Shard


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

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting_in_db or any(self.depth.values()))

    @property
    def blocked(self) -> bool:
        """Work is waiting and no live worker serves this model's queues."""
        return self.has_work and not self.workers


@dataclass
class Health:
    models: list[ModelHealth]
    control_depth: int
    control_workers: int
    redis_ok: bool = True
    redis_error: str = ""


# Every open batch page asks on each poll: one answer per model serves them for a while.
_BLOCKER_TTL_SECONDS = 5.0
_blockers: dict[str, tuple[float, str]] = {}


def progress_blocker(model: str) -> str:
    """Why a running batch of `model` cannot make progress right now, in words for its
    page; "" when it can (Redis answers and a live worker takes the model's queues)."""
    now = time.monotonic()
    cached = _blockers.get(model)
    if cached and now - cached[0] < _BLOCKER_TTL_SECONDS:
        return cached[1]
    own = set(queues.model_queue_names(model))
    try:
        alive = any(own & set(w.queue_names()) for w in _workers(queues.connection()))
        reason = "" if alive else (f"no worker for {model} is running; it resumes as soon "
                                   "as one starts")
    except Exception:  # Redis down or unreachable
        reason = "the queue (Redis) cannot be reached; workers wait for it to come back"
    _blockers[model] = (now, reason)
    return reason


def _workers(connection: Any) -> list[Any]:
    return Worker.all(connection=connection)


def _info(worker: Any) -> WorkerInfo:
    job_id = worker.get_current_job_id()
    return WorkerInfo(name=worker.name, state=str(worker.get_state()),
                      queues=worker.queue_names(), last_heartbeat=worker.last_heartbeat,
                      current_job=job_id)


def queue_health(*, now: datetime | None = None) -> Health:
    now = now or timezone.now()
    models = {name: ModelHealth(model=name, depth={}) for name in model_names()}
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
    stale = set(Shard.objects.stale(now).values_list("pk", flat=True))
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
            stuck=shard.pk in stale))
    for row in Shard.objects.filter(status=Shard.Status.QUEUED, enqueued_at__isnull=True
                                    ).values("batch__model").annotate(n=Count("id")):
        model = row["batch__model"]
        models.setdefault(model, ModelHealth(model=model, depth={})).waiting_in_db = row["n"]
    return Health(models=list(models.values()), control_depth=control_depth,
                  control_workers=control_workers, redis_ok=redis_ok, redis_error=redis_error)


def shard_counts_by_model() -> dict[tuple[str, str], int]:
    """(model, status) -> shards, for queued and running shards."""
    rows = Shard.objects.in_line().values(
        model=F("batch__model"), st=F("status")).annotate(n=Count("id"))
    return {(r["model"], r["st"]): r["n"] for r in rows}
