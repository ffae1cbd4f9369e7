"""The worker's periodic duties, on a thread of their own: the reconciler (every worker runs
it, so no scheduler process is needed) and the sweep of this machine's scratch directory.
A reconcile pass over many batches may take seconds; on this thread it never delays the
heartbeats that keep this worker's shards from being presumed dead."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from jobs.services.cleanup import sweep_temp_dir
from jobs.services.reconcile import reconcile_if_due
from jobs.worker.loop import Loop


class Duty:
    """One duty run every `every` seconds (never when `every` is 0)."""

    def __init__(self, name: str, run: Callable[[], object], every: float, *,
                 last: float = 0.0) -> None:
        self.name = name
        self.run = run
        self.every = every
        self.last = last

    def due_in(self, now: float) -> float:
        return self.last + self.every - now if self.every > 0 else float("inf")


class Periodic(Loop):
    name = "periodic"

    def __init__(self, closing: threading.Event, *, reconcile_every: float,
                 sweep_every: float) -> None:
        self.closing = closing
        self.duties = [
            Duty("reconcile", lambda: reconcile_if_due(every=reconcile_every), reconcile_every),
            # The worker swept TMP_DIR as it started; TMP_DIR is this machine's, so every
            # worker sweeps it.
            Duty("temp sweep", sweep_temp_dir, sweep_every, last=time.monotonic()),
        ]
        super().__init__()

    def _loop(self) -> None:
        while not self.closing.wait(self._wait()):
            for duty in self.duties:
                if duty.due_in(time.monotonic()) > 0:
                    continue
                duty.last = time.monotonic()
                self.step(duty.name, duty.run)

    def _wait(self) -> float:
        # Until the next duty is due; capped so a loop with no duty still notices closing.
        now = time.monotonic()
        return max(0.05, min(60.0, *(duty.due_in(now) for duty in self.duties)))
