"""The top-up thread: after each claim, the claimed shard's batch gets its next shards into
Redis (jobs.services.scheduling.enqueue_next_shards) here, not in the claim itself, so the
engine gets a shard's first requests without waiting for that. Claims of the same batch
made meanwhile need one top-up. If the worker dies first, the reconciler tops up."""

from __future__ import annotations

import functools
import queue

from jobs.services.scheduling import enqueue_next_shards
from jobs.worker.loop import Loop
from jobs.worker.timings import timed


class TopUp(Loop):
    name = "top-up"

    def __init__(self) -> None:
        self.batches: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        super().__init__()

    def request(self, batch_id: str) -> None:
        self.batches.put(batch_id)

    def join(self, timeout: float) -> None:
        self.batches.put(None)
        super().join(timeout)

    def _loop(self) -> None:
        while (batch_id := self.batches.get()) is not None:
            due = {batch_id}
            while True:  # the claims made meanwhile
                try:
                    more = self.batches.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self.batches.put(None)
                    break
                due.add(more)
            for batch in due:
                # One that fails is the reconciler's to top up.
                self.step(f"top-up of batch {batch}", functools.partial(self._top_up, batch))

    @staticmethod
    def _top_up(batch_id: str) -> None:
        with timed("topup"):
            enqueue_next_shards(batch_id=batch_id)
