"""How long the engine waited for work while this worker had some (the benchmarks read it)."""

from __future__ import annotations

import threading
import time


class IdleMeter:
    """How long the engine had nothing to do while this worker had work: the time with no
    request in flight, between the first request handed in and the last result out.
    Reported when the worker stops."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        # Notified as requests finish: the intake waits on it for room in the engine's batch.
        self.room = threading.Condition(self.lock)
        self.in_flight = 0
        self.requests = 0
        self.first: float | None = None
        # None until a result came out: a worker stopped before any result has no window
        # (not one from the clock's origin to its first request).
        self.last: float | None = None
        self.idle_since: float | None = None
        self.idle_total = 0.0

    def request_started(self) -> None:
        now = time.monotonic()
        with self.lock:
            if self.first is None:
                self.first = now
            if self.in_flight == 0 and self.idle_since is not None:
                self.idle_total += now - self.idle_since
                self.idle_since = None
            self.in_flight += 1
            self.requests += 1

    def request_finished(self) -> None:
        now = time.monotonic()
        with self.lock:
            self.in_flight = max(0, self.in_flight - 1)
            self.last = now
            if self.in_flight == 0:
                self.idle_since = now
            self.room.notify_all()

    def wait_for_room(self, limit: int, timeout: float) -> bool:
        """Wait until fewer than `limit` requests are in flight (True), or `timeout`."""
        with self.lock:
            return self.room.wait_for(lambda: self.in_flight < limit, timeout)

    def window(self) -> float:
        if self.first is None or self.last is None:
            return 0.0
        return max(0.0, self.last - self.first)

    def fraction(self) -> float:
        window = self.window()
        return min(1.0, self.idle_total / window) if window > 0 else 0.0
