"""The checkpointer thread: a running shard's finished results saved to storage every
CHECKPOINT_SECONDS or CHECKPOINT_REQUESTS new results, so the attempt that follows an
unfinished one (worker killed, handed back on SIGTERM, failed) computes only what was not
saved. Each checkpoint stores what the parts got since the last one as a segment
(shared storage: any machine's worker can adopt it) and records it on the shard row under
this attempt; a worker presumed dead records nothing and deletes what it stored."""

from __future__ import annotations

import functools
import logging
import threading
import time

from jobs.worker.db import ShardStore
from jobs.worker.loop import Loop
from jobs.worker.part_storage import delete_stored, store_segment
from jobs.worker.state import WorkerState
from jobs.worker.work import ShardWork

log = logging.getLogger(__name__)


class Checkpointer(Loop):
    name = "checkpoint"

    def __init__(self, state: WorkerState, *, store: ShardStore, every_seconds: float,
                 every_requests: int) -> None:
        self.state = state
        self.store = store
        self.every_seconds = every_seconds
        self.every_requests = max(1, every_requests)
        # Set by the dispatcher when a shard has CHECKPOINT_REQUESTS unsaved results, or
        # a first one while the loop waits with none (`timing` False).
        self.wake = threading.Event()
        self.timing = False
        super().__init__()

    def join(self, timeout: float) -> None:
        self.wake.set()
        super().join(timeout)

    def notice(self, unsaved_results: int) -> None:
        """Called by the dispatcher after each result, with the shard's unsaved count."""
        if unsaved_results >= self.every_requests or (unsaved_results and not self.timing):
            self.wake.set()

    def _loop(self) -> None:
        state = self.state
        wait = self.every_seconds
        while not state.closing.is_set():
            self.wake.wait(wait)
            self.wake.clear()
            for work in state.current_works():
                if state.closing.is_set() or not self._due(work):
                    continue
                self.step(f"checkpoint of shard {work.shard_id}",
                          functools.partial(self.save, work))
            wait = self._wait()

    def _wait(self) -> float:
        """Until the first shard with unsaved results is due, rather than a look every
        half second: at least that half second (a checkpoint put off by a heartbeat or a
        finish is tried again then), at most CHECKPOINT_SECONDS (results no notice
        announced: a stopped batch's lines never run)."""
        # Cleared before the shards are read: a first unsaved result counted from here
        # on wakes the loop (`notice`), whether or not the reading below saw it.
        self.timing = False
        now = time.monotonic()
        left = []
        for work in self.state.current_works():
            with work.lock:
                if work.unsaved_results():
                    left.append(work.saved_at + self.every_seconds - now)
        self.timing = bool(left)
        poll = min(0.5, self.every_seconds)
        return min(self.every_seconds, max(poll, min(left, default=self.every_seconds)))

    def _due(self, work: ShardWork) -> bool:
        with work.lock:
            unsaved = work.unsaved_results()
        return unsaved > 0 and (unsaved >= self.every_requests
                                or time.monotonic() - work.saved_at >= self.every_seconds)

    def save(self, work: ShardWork, *, final: bool = False) -> bool:
        """Checkpoint what the attempt has written. `final`: the shard is being handed back
        (its results have stopped coming in), so wait for a checkpoint in progress and take
        one even while handing back. True when the row holds everything written."""
        if not work.checkpoint_lock.acquire(blocking=final):
            return False
        try:
            with work.lock:
                if work.dead or (not final and (work.finishing or work.handing_back)):
                    return False
                if not work.unsaved_results():
                    return True
                checkpoint, sizes, computed = work.snapshot()
                checkpoint.usage.engine_seconds += self.state.idle.engine_seconds(
                    work.attempt_key)
                start = work.saved_offsets()
                segments = list(work.saved.segments)
            checkpoint.segments = [*segments, store_segment(work, start, sizes)]
            new = [name for name in checkpoint.segments[-1] if name]
            with work.lock:
                unsaved = work.computed - computed
            # Should this raise, the UPDATE may still have committed: what was stored stays
            # (an orphan, if unrecorded, for the cleanup's sweep once the batch ends).
            recorded = self.store.checkpoint(work, checkpoint, unsaved=unsaved)
            if not recorded:
                log.warning("shard %s attempt %d is no longer running; checkpoint dropped",
                            work.shard_id, work.attempt)
                delete_stored(new)
                return False
            with work.lock:
                work.mark_saved(checkpoint, sizes, computed)
            return True
        finally:
            work.checkpoint_lock.release()
