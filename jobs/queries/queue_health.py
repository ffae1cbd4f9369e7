"""What the queues and workers are doing, read from Redis and the database at the moment
of asking: the admin's queue-health page and the /metrics endpoint share it.

A worker is *lost* when its RQ registration's heartbeat (refreshed every
HEARTBEAT_SECONDS by batchworker's presence thread) is older than
HEARTBEAT_TIMEOUT_SECONDS: the same rule by which the reconciler takes its shards away. A
killed worker stays registered until its key expires (minutes), so a host whose machine
died shows as a host whose every worker is lost, with the shards it still holds.

A worker is *busy* while it holds a running shard, whatever RQ says: RQ's job only claims
a shard and hands it to the engine pipeline, which runs it on after the job has returned
(RQ then calls the worker idle, with no current job). Its current job is then the oldest
shard it holds. Its tokens per second are what its presence thread reports (jobs.capacity.fleet)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import Count, F
from django.utils import timezone
from rq import Worker

from engine.remote_limits import DEFAULT_CEILING, ServerState, server_state
from jobs.capacity.fleet import WorkerRate, standby_models, worker_rates
from jobs.capacity.plan import ModelPlan, plans
from jobs.lib import queues
from jobs.lib.model_registry import model_names, model_spec, model_specs
from jobs.models import Shard


@dataclass
class WorkerInfo:
    name: str
    state: str
    queues: list[str]
    last_heartbeat: datetime | None
    current_job: str | None
    hostname: str = ""
    model: str = ""  # the model whose queues it takes ("" for none)
    heartbeat_age: timedelta | None = None
    lost: bool = False  # not heard of for HEARTBEAT_TIMEOUT_SECONDS
    held: list[str] = field(default_factory=list)  # running shards under its name, oldest first
    rate: WorkerRate | None = None  # its throughput as its presence reports it

    @property
    def shards_held(self) -> int:
        return len(self.held)

    @property
    def status(self) -> str:
        """"lost", "busy" while it holds a running shard, else RQ's state (idle, ...)."""
        return "lost" if self.lost else "busy" if self.held else self.state

    @property
    def job(self) -> str | None:
        """What it works on: RQ's current job, else the oldest shard it holds."""
        return self.current_job or (self.held[0] if self.held else None)


@dataclass
class HostHealth:
    """The workers registered from one machine (RQ's record of its host name)."""

    hostname: str
    workers: list[WorkerInfo] = field(default_factory=list)

    @property
    def live(self) -> list[WorkerInfo]:
        return [w for w in self.workers if not w.lost]

    @property
    def lost_workers(self) -> list[WorkerInfo]:
        return [w for w in self.workers if w.lost]

    @property
    def lost(self) -> bool:
        """Every worker of the host is silent: the machine (or its network) is gone."""
        return not self.live

    @property
    def models(self) -> list[str]:
        return sorted({w.model for w in self.workers if w.model})

    @property
    def shards_held(self) -> int:
        return sum(w.shards_held for w in self.workers)

    @property
    def last_heartbeat(self) -> datetime | None:
        beats = [w.last_heartbeat for w in self.workers if w.last_heartbeat is not None]
        return max(beats) if beats else None

    @property
    def heartbeat_age(self) -> timedelta | None:
        ages = [w.heartbeat_age for w in self.workers if w.heartbeat_age is not None]
        return min(ages) if ages else None


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
    workers: list[WorkerInfo] = field(default_factory=list)  # alive
    lost_workers: list[WorkerInfo] = field(default_factory=list)
    # Alive workers loaded with another model that switch to this one when it waits.
    standby: list[WorkerInfo] = field(default_factory=list)
    running: list[RunningShard] = field(default_factory=list)
    waiting_in_db: int = 0  # queued shards without a job (fair share, backoff)
    # The capacity plan of its running batches (None: none runs).
    plan: ModelPlan | None = None

    @property
    def stuck(self) -> list[RunningShard]:
        return [s for s in self.running if s.stuck]

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting_in_db or any(self.depth.values()))

    @property
    def blocked(self) -> bool:
        """Work is waiting and no live worker serves this model's queues or will switch
        to it."""
        return self.has_work and not self.workers and not self.standby


@dataclass
class RemoteServer:
    """A server remote models run on, as every worker naming it shares it."""

    models: list[str]
    ceiling: int
    state: ServerState


@dataclass
class Health:
    models: list[ModelHealth]
    control_depth: int
    control_workers: int
    redis_ok: bool = True
    redis_error: str = ""
    hosts: list[HostHealth] = field(default_factory=list)
    servers: list[RemoteServer] = field(default_factory=list)

    @property
    def lost_hosts(self) -> list[HostHealth]:
        return [h for h in self.hosts if h.lost]


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
        stamp = timezone.now()
        # A worker of a host that died stays registered until Redis forgets it: lost.
        alive = any((own & set(w.queue_names()) or model in standby_models(w))
                    and not _heartbeat(w, stamp)[2] for w in _workers(queues.connection()))
        reason = "" if alive else (f"no worker for {model} is running; it resumes as soon "
                                   "as one starts")
        if not reason:
            reason = _server_blocker(model, queues.connection())
    except Exception:  # Redis down or unreachable
        reason = "the queue (Redis) cannot be reached; workers wait for it to come back"
    _blockers[model] = (now, reason)
    return reason


def _server_blocker(model: str, connection: Any) -> str:
    """For a remote model: its server cannot be reached, or it is throttling us."""
    spec = model_spec(model)
    if spec is None or spec.backend != "remote":
        return ""
    url = spec.options["base_url"]
    state = server_state(connection, url, ceiling=spec.options.get("max_concurrency",
                                                                    DEFAULT_CEILING))
    # The batch's owner reads this: the server's address and the error's text are for
    # staff (queue health), never for users.
    if state.condition == "unreachable":
        return ("its server cannot be reached; its requests wait and run as soon as it "
                "answers")
    if state.condition == "busy":
        return ("its server is busy (it refused or queued our requests lately); its "
                "requests wait and are retried as it frees up")
    return ""


def remote_servers(connection: Any) -> list[RemoteServer]:
    """Every server the remote models run on, once per base URL."""
    found: dict[str, RemoteServer] = {}
    for spec in model_specs():
        if spec.backend != "remote":
            continue
        url = str(spec.options["base_url"]).rstrip("/")
        ceiling = int(spec.options.get("max_concurrency", DEFAULT_CEILING))
        if url in found:
            found[url].models.append(spec.name)
            continue
        found[url] = RemoteServer(models=[spec.name], ceiling=ceiling,
                                  state=server_state(connection, url, ceiling=ceiling))
    return list(found.values())


def _workers(connection: Any) -> list[Any]:
    return Worker.all(connection=connection)


def _heartbeat(worker: Any, now: datetime) -> tuple[datetime | None, timedelta | None, bool]:
    """(last heartbeat, its age, lost): the one rule of a worker being lost."""
    beat = worker.last_heartbeat
    if beat is not None and beat.tzinfo is None:
        beat = beat.replace(tzinfo=UTC)  # RQ stores UTC
    age = max(now - beat, timedelta(0)) if beat is not None else None
    timeout = timedelta(seconds=settings.BATCHWEB["HEARTBEAT_TIMEOUT_SECONDS"])
    return beat, age, age is None or age > timeout


def _info(worker: Any, *, now: datetime, model: str) -> WorkerInfo:
    job_id = worker.get_current_job_id()
    beat, age, lost = _heartbeat(worker, now)
    state = worker.get_state()
    return WorkerInfo(name=worker.name, state=str(getattr(state, "value", state)),
                      queues=worker.queue_names(), last_heartbeat=beat, current_job=job_id,
                      hostname=worker.hostname or "", model=model, heartbeat_age=age,
                      lost=lost)


def _hold(infos: list[WorkerInfo], running: dict[str, list[str]]) -> None:
    """Give each worker the running shards recorded under its name. A shard records
    batchworker's name; RQ's registration has that name, or `<name>.<n>` once batchworker
    re-registered after a Redis outage (the newest live one holds them)."""
    by_name: dict[str, list[WorkerInfo]] = {}
    for info in infos:
        by_name.setdefault(info.name, []).append(info)
        base, _, loop = info.name.rpartition(".")
        if base and loop.isdigit():
            by_name.setdefault(base, []).append(info)
    for name, shard_ids in running.items():
        candidates = by_name.get(name)
        if candidates:
            holder = min(candidates, key=lambda w: (w.lost, w.heartbeat_age or timedelta.max))
            holder.held.extend(shard_ids)


def queue_health(*, now: datetime | None = None) -> Health:
    now = now or timezone.now()
    models = {name: ModelHealth(model=name, depth={}) for name in model_names()}
    redis_ok, redis_error, control_depth, control_workers = True, "", 0, 0
    infos: list[WorkerInfo] = []
    servers: list[RemoteServer] = []
    try:
        connection = queues.connection()
        servers = remote_servers(connection)
        workers = _workers(connection)
        control_depth = queues.queue(queues.CONTROL_QUEUE).count
        owners = {q: name for name in models for q in queues.model_queue_names(name)}
        for worker in workers:
            served = [owners[q] for q in worker.queue_names() if q in owners]
            info = _info(worker, now=now, model=served[0] if served else "")
            infos.append(info)
            if queues.CONTROL_QUEUE in info.queues and not info.lost:
                control_workers += 1
            if info.model:
                health = models[info.model]
                (health.lost_workers if info.lost else health.workers).append(info)
            for other in standby_models(worker) if not info.lost else ():
                if other in models:
                    models[other].standby.append(info)
        for name, health in models.items():
            for priority, queue_name in zip(queues.PRIORITIES, queues.model_queue_names(name),
                                            strict=True):
                health.depth[priority] = queues.queue(queue_name).count
            rates = {rate.name: rate for rate in worker_rates(
                connection, name, max_age=settings.BATCHWEB["HEARTBEAT_TIMEOUT_SECONDS"])}
            for info in health.workers:
                info.rate = rates.get(info.name)
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
    held: dict[str, list[str]] = {}
    for model_health in models.values():
        for running_shard in model_health.running:  # oldest first
            held.setdefault(running_shard.worker, []).append(running_shard.id)
    _hold(infos, held)
    for plan in plans(now=now):
        models.setdefault(plan.model, ModelHealth(model=plan.model, depth={})).plan = plan
    hosts: dict[str, HostHealth] = {}
    for info in sorted(infos, key=lambda w: w.name):
        hosts.setdefault(info.hostname, HostHealth(hostname=info.hostname)).workers.append(info)
    return Health(models=list(models.values()), control_depth=control_depth,
                  control_workers=control_workers, redis_ok=redis_ok, redis_error=redis_error,
                  hosts=sorted(hosts.values(), key=lambda h: h.hostname), servers=servers)


def shard_counts_by_model() -> dict[tuple[str, str], int]:
    """(model, status) -> shards, for queued and running shards."""
    rows = Shard.objects.in_line().values(
        model=F("batch__model"), st=F("status")).annotate(n=Count("id"))
    return {(r["model"], r["st"]): r["n"] for r in rows}
