"""The heartbeat thread: keeps this worker's claimed shards alive in the database (with
their progress), drops shards that are no longer this attempt's, and stops the requests of
shards whose batch was cancelled or expired."""

from __future__ import annotations

import logging

from jobs.formats.checkpoint_record import Progress
from jobs.services.shards import Beat
from jobs.worker.db import ShardStore
from jobs.worker.loop import Loop
from jobs.worker.state import WorkerState

log = logging.getLogger(__name__)


class Heartbeat(Loop):
    name = "heartbeat"

    def __init__(self, state: WorkerState, *, store: ShardStore, every: float) -> None:
        self.state = state
        self.store = store
        self.every = every
        # What the last beat wrote of each attempt's progress (shard id, attempt): a beat
        # that writes the same again leaves the batch's sums alone.
        self.written: dict[tuple[str, int], Progress] = {}
        super().__init__()

    def _loop(self) -> None:
        while not self.state.closing.wait(self.every):
            self.step("heartbeat", self.beat)

    def beat(self) -> None:
        """One heartbeat for all of this worker's shards (one transaction, each batch's
        sums and stop code once)."""
        state = self.state
        works = state.current_works()
        current = {(work.shard_id, work.attempt) for work in works}
        self.written = {key: seen for key, seen in self.written.items() if key in current}
        if not works:
            return
        # The unsaved counts are read and written with no checkpoint in between: one
        # recorded meanwhile would otherwise be overwritten by this older, larger count
        # (and a lost attempt's recomputed requests over-counted). While a checkpoint
        # is being taken, the heartbeat leaves its shard's count to it.
        counting = [work.checkpoint_lock.acquire(blocking=False) for work in works]
        try:
            beats, snapshots = [], []
            for work, counts in zip(works, counting, strict=True):
                with work.lock:
                    snapshot = Progress(**work.progress.as_fields())
                    unsaved = work.computed - work.saved_computed if counts else None
                key = (work.shard_id, work.attempt)
                beats.append(Beat(work.shard_id, work.attempt, work.batch_id, snapshot,
                                  unsaved, moved=self.written.get(key) != snapshot))
                snapshots.append((key, snapshot))
            mine, stop_codes = self.store.heartbeat(beats)
            self.written.update(snapshots)
        finally:
            for work, counts in zip(works, counting, strict=True):
                if counts:
                    work.checkpoint_lock.release()
        for work in works:
            stop_code = stop_codes.get(work.batch_id, "")
            if work.shard_id not in mine and not work.finishing:
                log.warning("shard %s is no longer ours; dropping it", work.shard_id)
                state.drop(work)
            elif stop_code and not work.stop_code:
                with work.lock:
                    work.stop_code = stop_code
                    in_flight = list(work.pending)
                log.info("shard %s stopping: %s", work.shard_id, stop_code)
                state.engine.abort(in_flight)
