"""A shard's last step on this worker: once its last result is written (by the dispatcher, or
by the intake when nothing was left to run), its parts are stored and it is recorded done,
fenced by its attempt."""

from __future__ import annotations

import logging

from jobs.storage.external import shown_reason
from jobs.worker.db import ShardStore
from jobs.worker.part_storage import delete_stored, store_parts
from jobs.worker.state import WorkerState
from jobs.worker.work import ShardWork

log = logging.getLogger(__name__)


def finish(state: WorkerState, work: ShardWork, *, store: ShardStore) -> None:
    """Store the shard's parts and record it done, or fail the attempt if storing fails;
    a part is attached to the shard only if the attempt is still current."""
    stored: list[str] = []
    # No checkpoint may be half taken while the parts are stored, nor start after.
    work.checkpoint_lock.acquire()
    try:
        store_parts(work, stored)
        work.usage.engine_seconds += state.idle.engine_seconds(work.attempt_key, take=True)
        if store.finish(work, stored):
            # The parts hold the checkpoint's results now (the row no longer names it).
            delete_stored(work.saved.storage_names())
        else:
            log.warning("shard %s attempt %d was taken over; discarding its results",
                        work.shard_id, work.attempt)
            delete_stored(stored)
    except Exception as exc:
        log.exception("could not store results of shard %s", work.shard_id)
        delete_stored(stored)
        # The reason ends up in the users' error lines: never the storage's address.
        store.fail(work, f"storing results failed: {shown_reason(exc)}")
    finally:
        work.checkpoint_lock.release()
        work.discard()
        state.unregister(work)
