"""A shard's last step on this worker: once its last result is written (by the dispatcher, or
by the intake when nothing was left to run), its parts are stored and it is recorded done,
fenced by its attempt."""

from __future__ import annotations

import logging

from jobs.services import shards as shard_service
from jobs.worker.db import with_db_retry
from jobs.worker.parts import ShardWork, delete_stored, store_parts
from jobs.worker.state import WorkerState
from jobs.worker.timings import timed

log = logging.getLogger(__name__)


def finish(state: WorkerState, work: ShardWork) -> None:
    """Store the shard's parts and record it done, or fail the attempt if storing fails;
    a part is attached to the shard only if the attempt is still current."""
    stored: list[str] = []
    # No checkpoint may be half taken while the parts are stored, nor start after.
    work.checkpoint_lock.acquire()
    try:
        store_parts(work, stored)
        work.usage.engine_seconds += state.idle.engine_seconds(work.attempt_key, take=True)
        with timed("finish"):
            finished = with_db_retry(lambda: shard_service.finish_shard(
                shard_id=work.shard_id, attempt=work.attempt, output_part=stored[0],
                error_part=stored[1], flags_part=stored[2], progress=work.progress,
                flag_counts=work.flag_counts, json_retries=work.json_retries,
                usage=work.usage))
        if finished:
            # The parts hold the checkpoint's results now (the row no longer names it).
            delete_stored(work.saved.storage_names())
        else:
            log.warning("shard %s attempt %d was taken over; discarding its results",
                        work.shard_id, work.attempt)
            delete_stored(stored)
    except Exception as exc:
        log.exception("could not store results of shard %s", work.shard_id)
        delete_stored(stored)
        reason = f"storing results failed: {type(exc).__name__}: {exc}"
        with_db_retry(lambda: shard_service.fail_shard(
            shard_id=work.shard_id, attempt=work.attempt, reason=reason))
    finally:
        work.checkpoint_lock.release()
        work.discard()
        state.unregister(work)
