"""Database calls of the worker's threads, retried across a dropped connection (PostgreSQL
restarted, backend terminated). The worker reaches the database through one object,
`ShardStore`: a shard's claim, the reads that open its work, what it records of the engine
and adapters that serve it, its heartbeats and checkpoints, and how its attempt ends
(finished, failed, handed back, its batch stopped); besides, the adapter registry and the
shards waiting for another model. Each is one service call or one read, a read or a
conditional write fenced by the attempt, so repeating it after a lost connection is safe.
The periodic duties and the top-up run services of their own, each step on its own thread."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any, ParamSpec, TypeVar

from django.db import InterfaceError, OperationalError, close_old_connections, connection
from django.db.models import Min

from jobs.formats.checkpoint_record import Checkpoint
from jobs.lib import queues
from jobs.models import LoraAdapter, Shard
from jobs.services import evals, shard_input, shards, stopping, what_ran
from jobs.worker.timings import timed
from jobs.worker.work import ShardWork

log = logging.getLogger(__name__)
T = TypeVar("T")
P = ParamSpec("P")


def with_db_retry(fn: Callable[[], T], *, attempts: int = 5) -> T:
    """Run a database call, reconnecting if the connection was dropped. Each call is one
    conditional write, or a read, safe to repeat."""
    for attempt in range(attempts):
        try:
            return fn()
        except (OperationalError, InterfaceError):
            if attempt == attempts - 1:
                raise
            log.warning("database connection lost; reconnecting", exc_info=True)
            connection.close()
            time.sleep(min(2**attempt, 10))
    raise AssertionError("unreachable")


def _retried(method: Callable[P, T]) -> Callable[P, T]:
    """The method, run by `with_db_retry`."""
    @functools.wraps(method)
    def call(*args: P.args, **kwargs: P.kwargs) -> T:
        return with_db_retry(lambda: method(*args, **kwargs))
    return call


class ShardStore:
    """The worker's database: a shard's row as this worker reads and writes it, every call
    fenced by the attempt (a worker presumed dead changes nothing), and the reads the
    worker makes beside it (the adapter registry, the shards waiting for another model).
    Each call is retried across a dropped connection, a heartbeat excepted: the next beat
    is its retry."""

    def __init__(self, *, worker: str) -> None:
        self.worker = worker

    @timed("claim")  # the retries included: a slow claim is slow however it is slow
    @_retried
    def claim(self, shard_id: str) -> Shard | None:
        """The shard, claimed for a new attempt; None when it is not ours to run. The
        batch's next shards are the caller's to enqueue (jobs.worker.topup), so the engine
        gets this one's first requests without waiting for that."""
        # The RQ job's thread keeps its connection from job to job: one past its age, or
        # broken meanwhile, is closed first (as Django does between requests).
        close_old_connections()
        return shards.claim_shard(shard_id=shard_id, worker=self.worker, top_up=False)

    @_retried
    def open(self, shard: Shard) -> ShardWork:
        """The claimed shard's work state, started from the checkpoint its claim handed on
        (reads only)."""
        return ShardWork.opened(shard, shard_input.open_input(shard))

    @_retried
    def record_claim(self, shard: Shard, *, engine: dict[str, Any]) -> bool:
        """Record the engine (its provenance record) on the claimed attempt and its batch;
        False when the attempt is no longer the shard's."""
        return what_ran.record_claim(shard=shard, worker=self.worker, engine=engine)

    @_retried
    def start_evals(self, shard: Shard, *, serving_key: str, watch: bool
                    ) -> list[str] | None:
        """The eval runs the claim starts (jobs.services.evals.start_runs)."""
        return evals.start_runs(batch=shard.batch, serving_key=serving_key, watch=watch)

    @_retried
    def adapter_source(self, name: str, *, base_model: str) -> str | None:
        """Where the registered LoRA adapter `name` of `base_model` comes from; None when
        no such adapter is registered (any longer)."""
        return LoraAdapter.objects.filter(name=name, base_model=base_model).values_list(
            "source", flat=True).first()

    @_retried
    def record_adapter(self, shard: Shard, *, engine: dict[str, Any],
                       adapter: dict[str, str]) -> bool:
        """Add an adapter the attempt's requests load to its provenance and its batch's."""
        return what_ran.record_adapter(shard=shard, worker=self.worker, engine=engine,
                                       adapter=adapter)

    def heartbeat(self, beats: list[shards.Beat]) -> tuple[set[str], dict[str, str]]:
        """Keep the attempts alive with their progress, together: (the shards still ours,
        each batch's stop code). Not retried: the heartbeat thread beats again a few
        seconds later."""
        with timed("heartbeat"):
            return shards.heartbeats(beats=beats)

    @_retried
    def checkpoint(self, work: ShardWork, checkpoint: Checkpoint, *, unsaved: int = 0
                   ) -> bool:
        """Record a checkpoint whose segments are stored; False when the attempt is no
        longer the running one (the caller deletes what it stored for it)."""
        return shards.record_checkpoint(shard_id=work.shard_id, attempt=work.attempt,
                                        checkpoint=checkpoint, unsaved=unsaved)

    @timed("finish")
    @_retried
    def finish(self, work: ShardWork, parts: list[str]) -> bool:
        """Record the attempt's stored parts (output, error, flags) as the shard's results
        and charge them; False when the attempt was taken over (the caller deletes them)."""
        return shards.finish_shard(shard_id=work.shard_id, attempt=work.attempt,
                                   output_part=parts[0], error_part=parts[1],
                                   flags_part=parts[2], progress=work.progress,
                                   flag_counts=work.flag_counts,
                                   json_retries=work.json_retries, usage=work.usage)

    @_retried
    def fail(self, work: ShardWork, reason: str, *, input_changed: str = "") -> None:
        """The attempt failed: the shard is retried with backoff, or abandoned. When the
        batch's input, read in place, was replaced (`input_changed` says how), no attempt
        can run it on the registered data: the batch stops too, after the failure, so that
        the stop drops this shard with the others."""
        shards.fail_shard(shard_id=work.shard_id, attempt=work.attempt, reason=reason)
        if input_changed:
            stopping.stop_changed_input(batch_id=work.batch_id, reason=input_changed)

    @_retried
    def release(self, work: ShardWork, *, unsaved: int) -> None:
        """Hand the shard back (the worker stops) with its checkpoint; `unsaved`: the
        requests it computed that the checkpoint does not hold."""
        shards.release_shard(shard_id=work.shard_id, attempt=work.attempt, unsaved=unsaved)

    @_retried
    def queued_since(self, model: str, *, before: datetime) -> datetime | None:
        """When the oldest of `model`'s shards waiting in Redis went in, if at or before
        `before` (a shard's `enqueued_at` is when its job went into Redis)."""
        return Shard.objects.filter(
            status=Shard.Status.QUEUED, queue_name__in=queues.model_queue_names(model),
            enqueued_at__lte=before).aggregate(since=Min("enqueued_at"))["since"]
