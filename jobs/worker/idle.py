"""How long the engine waited for work while this worker had some (the benchmarks read it),
and how its busy time splits among the shard attempts it served (the ledger's engine
seconds)."""

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
        # A processor-sharing clock: it advances by dt / in_flight while requests are in
        # flight, so a request's share of the engine's time is the clock's advance while it
        # was in. Per shard attempt (request ids up to the line): [requests in flight, the
        # clock when last counted, seconds so far].
        self.clock = 0.0
        self.clock_at = time.monotonic()
        self.shares: dict[str, list[float]] = {}
        # The worker's throughput (jobs.capacity.fleet.WorkerRate, reported with its presence): the
        # seconds the engine had requests in flight, and the tokens of the answers it gave.
        self.busy_total = 0.0
        self.prompt_tokens = 0
        self.output_tokens = 0

    def _advance(self, now: float) -> None:
        if self.in_flight > 0:
            self.clock += (now - self.clock_at) / self.in_flight
            self.busy_total += now - self.clock_at
        self.clock_at = now

    def count_tokens(self, prompt: int, output: int) -> None:
        with self.lock:
            self.prompt_tokens += prompt
            self.output_tokens += output

    def totals(self) -> tuple[float, int, int]:
        """(busy seconds, prompt tokens, output tokens) since the worker started."""
        with self.lock:
            self._advance(time.monotonic())
            return self.busy_total, self.prompt_tokens, self.output_tokens

    def _count(self, request_id: str, step: int) -> None:
        if not request_id:
            return
        key = request_id.rsplit(":", 1)[0]
        share = self.shares.get(key)
        if share is None:
            if step < 0:
                return  # an attempt already taken or dropped
            share = self.shares[key] = [0, self.clock, 0.0]
        share[2] += share[0] * (self.clock - share[1])
        share[1] = self.clock
        share[0] = max(0, share[0] + step)

    def engine_seconds(self, attempt_key: str, *, take: bool = False) -> float:
        """The engine's time the requests of one shard attempt ("shard_id:attempt") took
        so far; `take`: and forget the attempt (it has finished or was dropped)."""
        with self.lock:
            self._advance(time.monotonic())
            share = (self.shares.pop(attempt_key, None) if take
                     else self.shares.get(attempt_key))
            if share is None:
                return 0.0
            return share[2] + share[0] * (self.clock - share[1])

    def request_started(self, request_id: str = "") -> None:
        now = time.monotonic()
        with self.lock:
            self._advance(now)
            self._count(request_id, +1)
            if self.first is None:
                self.first = now
            if self.in_flight == 0 and self.idle_since is not None:
                self.idle_total += now - self.idle_since
                self.idle_since = None
            self.in_flight += 1
            self.requests += 1

    def request_finished(self, request_id: str = "") -> None:
        now = time.monotonic()
        with self.lock:
            self._advance(now)
            self._count(request_id, -1)
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
