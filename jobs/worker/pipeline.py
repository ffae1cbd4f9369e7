"""`Pipeline`: the state the worker's threads share (the engine, the inbox, the shards in
flight) and its lifecycle: start, drain on SIGTERM, hand shards back, close."""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from typing import Any

from django.conf import settings

from engine.base import Engine
from jobs.services import shards as shard_service
from jobs.worker.adapters import AdapterFolders
from jobs.worker.checkpoint import Checkpointer
from jobs.worker.db import with_db_retry
from jobs.worker.dispatch import END, Dispatcher
from jobs.worker.heartbeat import Heartbeat
from jobs.worker.idle import IdleMeter
from jobs.worker.intake import Intake
from jobs.worker.parts import ShardWork
from jobs.worker.periodic import Periodic
from jobs.worker.served import Served
from jobs.worker.topup import TopUp

log = logging.getLogger(__name__)
# On hand-back, how long the results of requests already computed may take to come in.
HAND_BACK_WAIT = 5.0
_PIPELINE: Pipeline | None = None


def current_pipeline() -> Pipeline:
    if _PIPELINE is None:
        raise RuntimeError("run_shard runs only inside `manage.py batchworker`.")
    return _PIPELINE


class Pipeline:
    def __init__(self, engine: Engine, *, worker_name: str, inbox_size: int = 64,
                 reconcile_every: float | None = None) -> None:
        self.engine = engine
        self.worker_name = worker_name
        self.inbox: queue.Queue[Any] = queue.Queue(maxsize=inbox_size)
        self.works: dict[str, ShardWork] = {}
        self.works_lock = threading.Lock()
        self.broken: BaseException | None = None
        self.closing = threading.Event()
        self.idle = IdleMeter()
        conf = settings.BATCHWEB
        self.intake = Intake(self)
        self.adapters = AdapterFolders()
        self.served = Served(engine, worker_name=worker_name)
        self.dispatcher = Dispatcher(self)
        self.heartbeat = Heartbeat(self, every=conf["HEARTBEAT_SECONDS"])
        self.top_up = TopUp()
        self.checkpointer = Checkpointer(self, every_seconds=conf["CHECKPOINT_SECONDS"],
                                         every_requests=conf["CHECKPOINT_REQUESTS"])
        self.periodic = Periodic(
            self.closing,
            reconcile_every=(conf["RECONCILE_SECONDS"] if reconcile_every is None
                             else reconcile_every),
            sweep_every=conf["CLEANUP_INTERVAL_SECONDS"])

    # --- lifecycle ---

    def start(self) -> None:
        global _PIPELINE
        _PIPELINE = self
        self.dispatcher.start()
        self.heartbeat.start()
        self.top_up.start()
        self.checkpointer.start()
        self.periodic.start()

    def drain(self, timeout: float) -> None:
        """Wait for the shards in flight to finish; hand back what is left at the timeout."""
        deadline = time.monotonic() + timeout
        while self.works and time.monotonic() < deadline and self.broken is None:
            time.sleep(0.2)
        self.hand_back_all()

    def hand_back_all(self) -> None:
        """Hand every shard in flight back with a fresh checkpoint, so its next attempt
        computes nothing this one finished: stop its requests, let the results already
        computed come in (for at most HAND_BACK_WAIT seconds), checkpoint, release."""
        works = []
        for work in self.current_works():
            with work.lock:
                if work.dead or work.finishing:
                    continue  # the dispatcher is storing its parts
                work.handing_back = True
                in_flight = list(work.pending)
            works.append(work)
            if in_flight:
                self.engine.abort(in_flight)
        deadline = time.monotonic() + HAND_BACK_WAIT
        while (any(w.pending and not w.dead for w in works) and self.broken is None
               and time.monotonic() < deadline):
            time.sleep(0.02)
        for work in works:
            try:
                self.checkpointer.save(work, final=True)
            except Exception:
                log.exception("shard %s: no checkpoint before handing it back", work.shard_id)
            with work.lock:
                unsaved = work.computed - work.saved_computed
            self.drop(work)
            with_db_retry(functools.partial(shard_service.release_shard, shard_id=work.shard_id,
                                            attempt=work.attempt, unsaved=unsaved))
            log.info("handed back shard %s (%d results kept)", work.shard_id,
                     len(work.saved.lines))

    def close(self) -> None:
        global _PIPELINE
        log.info("engine idle %.2f%% of %.1fs with work (%d requests)",
                 100 * self.idle.fraction(), self.idle.window(), self.idle.requests)
        self.closing.set()
        self.inbox.put(END)
        self.dispatcher.join(timeout=30)
        self.heartbeat.join(timeout=30)
        self.top_up.join(timeout=30)
        self.checkpointer.join(timeout=30)
        self.periodic.join(timeout=30)
        self.engine.close()
        _PIPELINE = None

    def run_shard(self, shard_id: str) -> None:
        """Claim a shard and stream its requests into the engine; returns once all are
        handed in (the dispatcher finishes the shard)."""
        self.intake.run_shard(shard_id)

    # --- the shards in flight ---

    def register(self, work: ShardWork) -> None:
        with self.works_lock:
            self.works[work.shard_id] = work

    def unregister(self, work: ShardWork) -> None:
        with self.works_lock:
            self.works.pop(work.shard_id, None)

    def current_works(self) -> list[ShardWork]:
        with self.works_lock:
            return list(self.works.values())

    def drop(self, work: ShardWork) -> None:
        """Forget a shard's attempt: abort its requests in the engine, discard its results."""
        with work.lock:
            work.dead = True
            in_flight = list(work.pending)
            work.pending.clear()
        if in_flight:
            self.engine.abort(in_flight)
        self.idle.engine_seconds(work.attempt_key, take=True)
        work.discard()
        self.unregister(work)

    def fail_all(self, reason: str) -> None:
        for work in self.current_works():
            self.drop(work)
            try:
                with_db_retry(functools.partial(shard_service.fail_shard, shard_id=work.shard_id,
                                                attempt=work.attempt, reason=reason))
            except Exception:
                log.exception("could not record failure of shard %s", work.shard_id)
