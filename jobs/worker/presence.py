"""The presence thread: keeps this worker's RQ registration's `last_heartbeat` fresh.

RQ refreshes it only when a worker takes a job or its blocking wait for one times out
(about every 7 minutes when idle), and never while a SimpleWorker runs a job, which for
`run_shard` lasts as long as the engine's batch is full. So RQ's own heartbeat cannot tell
a busy or idle worker from one whose machine died. Refreshed here every HEARTBEAT_SECONDS,
like the shard heartbeats, it can: queue health and /metrics call a worker (and a host
whose workers all are) lost once it is older than HEARTBEAT_TIMEOUT_SECONDS. A dead
worker's registration stays listed until its key expires, minutes later, so the operator
sees the lost host rather than a host that quietly vanished.

A worker given several models (`batchworker --model A --model B`) takes only the queues of
the one loaded; the beat also writes the others into its registration (fleet.STANDBY_FIELD), so
queue health and the batch page know a worker will switch to them."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import redis
from rq import SimpleWorker
from rq.utils import now, utcformat
from rq.worker import BaseWorker

from jobs.capacity import fleet
from jobs.lib import queues
from jobs.worker.idle import IdleMeter
from jobs.worker.loop import Loop

log = logging.getLogger(__name__)

# The throughput a worker reports is measured over this many recent seconds, once the
# engine was busy for at least MIN_BUSY_SECONDS of them.
RATE_WINDOW = 60.0
MIN_BUSY_SECONDS = 1.0


# Refresh only a registration that is alive: never create the key before RQ registers the
# worker (RQ would then refuse to start it: "an active worker ... already"), nor revive
# one RQ marked dead. One round trip, atomic against RQ's own birth and death.
_BEAT = """
if redis.call('exists', KEYS[1]) == 1 and redis.call('hexists', KEYS[1], 'death') == 0 then
  redis.call('hset', KEYS[1], 'last_heartbeat', ARGV[1], ARGV[3], ARGV[4])
  redis.call('expire', KEYS[1], ARGV[2])
  return 1
end
return 0
"""


class Presence(Loop):
    name = "presence"

    def __init__(self, closing: threading.Event, *, every: float,
                 standby: tuple[str, ...] = (), model: str = "",
                 kv_cache_tokens: int = 0, meter: IdleMeter | None = None) -> None:
        self.closing = closing
        self.every = every
        self.standby = standby  # models this worker switches to when they wait
        # The loaded model's KV cache in tokens (0: none), reported for prefix planning.
        self.model = model
        self.kv_cache_tokens = kv_cache_tokens
        # The pipeline's meter: the worker's throughput, reported for the capacity plan.
        self.meter = meter
        # (monotonic time, busy seconds, prompt tokens, output tokens) of recent beats.
        self.samples: deque[tuple[float, float, int, int]] = deque()
        self.rate = (0.0, 0.0)  # prompt, output tokens per busy second, once measured
        # The RQ worker taking jobs now (batchworker starts a new one after a Redis outage).
        self.worker: BaseWorker | None = None
        super().__init__()

    def _loop(self) -> None:
        while not self.closing.wait(self.every):
            worker = self.worker
            if worker is None:
                continue
            try:
                self.beat(worker, self.standby)
                self.report(worker)
            except redis.RedisError:
                # Redis away: batchworker's loop reconnects and registers a new worker.
                log.debug("presence: Redis unavailable", exc_info=True)

    def report(self, worker: BaseWorker) -> None:
        """Report the loaded engine's KV cache (at start too: a batch validated then plans
        with it) and the worker's throughput (jobs.capacity.fleet)."""
        if self.kv_cache_tokens:
            fleet.report_kv_cache(worker.connection, worker.name, self.model,
                                  self.kv_cache_tokens, self.every)
        if self.model:
            fleet.report_rate(worker.connection, self.model, self.measure(worker.name),
                              self.every)

    def measure(self, name: str) -> fleet.WorkerRate:
        """The throughput over the last RATE_WINDOW seconds: tokens per busy second (kept
        from before while the worker idles: its speed when busy is what the plan needs)
        and the share of the window it was busy."""
        now = time.monotonic()
        busy, prompt, output = self.meter.totals() if self.meter else (0.0, 0, 0)
        self.samples.append((now, busy, prompt, output))
        while len(self.samples) > 2 and now - self.samples[1][0] >= RATE_WINDOW:
            self.samples.popleft()
        start = self.samples[0]
        busy_seconds = busy - start[1]
        if busy_seconds >= MIN_BUSY_SECONDS:
            self.rate = ((prompt - start[2]) / busy_seconds, (output - start[3]) / busy_seconds)
        wall = now - start[0]
        return fleet.WorkerRate(name=name, prompt_tokens_per_second=self.rate[0],
                                output_tokens_per_second=self.rate[1],
                                busy=min(1.0, busy_seconds / wall) if wall > 0 else 0.0,
                                stamp=time.time())

    @staticmethod
    def beat(worker: BaseWorker, standby: tuple[str, ...] = ()) -> bool:
        """Refresh `worker`'s registration; False if it is not (or no longer) registered."""
        script = worker.connection.register_script(_BEAT)
        # The key outlives a heartbeat by as long as RQ's own heartbeats make it.
        return bool(script(keys=[worker.key], args=[
            utcformat(now()), worker.worker_ttl + 60, fleet.STANDBY_FIELD, ",".join(standby)]))


def registered(name: str) -> bool:
    """Whether RQ holds a live registration for a worker of this name (RQ's own test in
    register_birth); False when Redis cannot say, since the worker rides out the outage."""
    key = SimpleWorker.redis_worker_namespace_prefix + name
    try:
        conn = queues.connection()
        return bool(conn.exists(key)) and not conn.hexists(key, "death")
    except redis.exceptions.RedisError:
        return False


def free_name(base: str, taken: Callable[[str], bool] = registered) -> str:
    """`base`, or `base.r2`, `base.r3`... : the first that no live RQ worker holds."""
    name, n = base, 1
    while taken(name):
        n += 1
        name = f"{base}.r{n}"
    return name
