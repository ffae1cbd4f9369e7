"""`Pipeline`: the worker's threads composed around their shared state (`state`), and its
lifecycle: start, drain on SIGTERM, hand shards back, close."""

from __future__ import annotations

import logging
import time

from django.conf import settings

from engine.base import Engine
from jobs.worker.adapters import AdapterFolders
from jobs.worker.checkpointer import Checkpointer
from jobs.worker.db import ShardStore
from jobs.worker.dispatch import Dispatcher
from jobs.worker.heartbeat import Heartbeat
from jobs.worker.intake import Intake
from jobs.worker.periodic import Periodic
from jobs.worker.served import Served
from jobs.worker.state import WorkerState
from jobs.worker.topup import TopUp

log = logging.getLogger(__name__)
# On hand-back, how long the results of requests already computed may take to come in.
HAND_BACK_WAIT = 5.0


class Pipeline:
    def __init__(self, engine: Engine, *, worker_name: str, inbox_size: int = 64,
                 reconcile_every: float | None = None) -> None:
        conf = settings.BATCHWEB
        self.state = state = WorkerState(engine, inbox_size=inbox_size)
        self.store = store = ShardStore(worker=worker_name)
        adapters = AdapterFolders(store=store)
        self.top_up = TopUp()
        self.checkpointer = Checkpointer(state, store=store,
                                         every_seconds=conf["CHECKPOINT_SECONDS"],
                                         every_requests=conf["CHECKPOINT_REQUESTS"])
        self.dispatcher = Dispatcher(state, store=store, adapters=adapters,
                                     notice_unsaved=self.checkpointer.notice)
        self.intake = Intake(state, store=store,
                             served=Served(engine, store=store, adapters=adapters),
                             top_up=self.top_up.request)
        self.heartbeat = Heartbeat(state, store=store, every=conf["HEARTBEAT_SECONDS"])
        self.periodic = Periodic(
            state.closing,
            reconcile_every=(conf["RECONCILE_SECONDS"] if reconcile_every is None
                             else reconcile_every),
            sweep_every=conf["CLEANUP_INTERVAL_SECONDS"])

    def start(self) -> None:
        self.intake.start()
        self.dispatcher.start()
        self.heartbeat.start()
        self.top_up.start()
        self.checkpointer.start()
        self.periodic.start()

    def drain(self, timeout: float) -> None:
        """Wait for the shards in flight to finish; hand back what is left at the timeout."""
        deadline = time.monotonic() + timeout
        while self.state.works and time.monotonic() < deadline and self.state.broken is None:
            time.sleep(0.2)
        self.hand_back_all()

    def hand_back_all(self) -> None:
        """Hand every shard in flight back with a fresh checkpoint, so its next attempt
        computes nothing this one finished: stop its requests, let the results already
        computed come in (for at most HAND_BACK_WAIT seconds), checkpoint, release."""
        state = self.state
        works = []
        for work in state.current_works():
            with work.lock:
                if work.dead or work.finishing:
                    continue  # the dispatcher is storing its parts
                work.handing_back = True
                in_flight = list(work.pending)
            works.append(work)
            if in_flight:
                state.engine.abort(in_flight)
        deadline = time.monotonic() + HAND_BACK_WAIT
        while (any(w.pending and not w.dead for w in works) and state.broken is None
               and time.monotonic() < deadline):
            time.sleep(0.02)
        for work in works:
            try:
                self.checkpointer.save(work, final=True)
            except Exception:
                log.exception("shard %s: no checkpoint before handing it back", work.shard_id)
            with work.lock:
                unsaved = work.computed - work.saved_computed
            state.drop(work)
            self.store.release(work, unsaved=unsaved)
            log.info("handed back shard %s (%d results kept)", work.shard_id,
                     len(work.saved.lines))

    def close(self) -> None:
        state = self.state
        log.info("engine idle %.2f%% of %.1fs with work (%d requests)",
                 100 * state.idle.fraction(), state.idle.window(), state.idle.requests)
        state.closing.set()
        self.dispatcher.join(timeout=30)  # ends the engine's request stream
        self.heartbeat.join(timeout=30)
        self.top_up.join(timeout=30)
        self.checkpointer.join(timeout=30)
        self.periodic.join(timeout=30)
        state.engine.close()
        self.intake.stop()
