"""`WorkerState`: what the worker's threads share while its engine is loaded: the engine, the
inbox that feeds it, the shards in flight, whether the engine broke, whether the worker is
closing, and the idle meter. Each thread is handed this one object; none of them reaches
another thread through it."""

from __future__ import annotations

import queue
import threading
from typing import Any

from engine.base import Engine
from jobs.worker.idle import IdleMeter
from jobs.worker.work import ShardWork


class WorkerState:
    def __init__(self, engine: Engine, *, inbox_size: int) -> None:
        self.engine = engine
        # Bounded: a full inbox blocks the intake, the backpressure that bounds memory.
        self.inbox: queue.Queue[Any] = queue.Queue(maxsize=inbox_size)
        self.works: dict[str, ShardWork] = {}
        self.works_lock = threading.Lock()
        # Set by the dispatcher when the engine fails: every thread stops taking work.
        self.broken: BaseException | None = None
        self.closing = threading.Event()
        self.idle = IdleMeter()

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
