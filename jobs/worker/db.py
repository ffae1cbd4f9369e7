"""Database calls of the worker's threads, retried across a dropped connection (PostgreSQL
restarted, backend terminated). A shard's row is reached through one object, `ShardStore`:
its claim, the reads that open its work, its checkpoints, and how its attempt ends
(finished, failed, handed back, its batch stopped). Each is one service call, a read or a
conditional write fenced by the attempt, so repeating it after a lost connection is safe."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from django.db import InterfaceError, OperationalError, connection

from jobs.formats.checkpoint import Checkpoint
from jobs.models import Shard
from jobs.services import shard_input, shards, stopping
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
    """A shard's row as this worker reads and writes it, every call fenced by the attempt
    (a worker presumed dead changes nothing) and retried across a dropped connection."""

    def __init__(self, *, worker: str) -> None:
        self.worker = worker

    @timed("claim")  # the retries included: a slow claim is slow however it is slow
    @_retried
    def claim(self, shard_id: str) -> Shard | None:
        """The shard, claimed for a new attempt; None when it is not ours to run. The
        batch's next shards are the caller's to enqueue (jobs.worker.topup), so the engine
        gets this one's first requests without waiting for that."""
        return shards.claim_shard(shard_id=shard_id, worker=self.worker, top_up=False)

    @_retried
    def open(self, shard: Shard) -> ShardWork:
        """The claimed shard's work state, started from the checkpoint its claim handed on
        (reads only)."""
        return ShardWork.opened(shard, shard_input.open_input(shard))

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
