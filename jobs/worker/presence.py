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
the one loaded; the beat also writes the others into its registration (STANDBY_FIELD), so
queue health and the batch page know a worker will switch to them."""

from __future__ import annotations

import logging
import threading

import redis
from rq.utils import now, utcformat
from rq.worker import BaseWorker

from jobs.worker.loop import Loop

log = logging.getLogger(__name__)

# The field of an RQ worker's registration listing the models it can switch to.
STANDBY_FIELD = "batchweb_standby"

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
                 standby: tuple[str, ...] = ()) -> None:
        self.closing = closing
        self.every = every
        self.standby = standby  # models this worker switches to when they wait
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
            except redis.RedisError:
                # Redis away: batchworker's loop reconnects and registers a new worker.
                log.debug("presence: Redis unavailable", exc_info=True)

    @staticmethod
    def beat(worker: BaseWorker, standby: tuple[str, ...] = ()) -> bool:
        """Refresh `worker`'s registration; False if it is not (or no longer) registered."""
        script = worker.connection.register_script(_BEAT)
        # The key outlives a heartbeat by as long as RQ's own heartbeats make it.
        return bool(script(keys=[worker.key], args=[
            utcformat(now()), worker.worker_ttl + 60, STANDBY_FIELD, ",".join(standby)]))


def standby_models(worker: BaseWorker) -> list[str]:
    """The models `worker` switches to when they wait (none for a one-model worker)."""
    value = worker.connection.hget(worker.key, STANDBY_FIELD)
    return [name for name in (value or b"").decode().split(",") if name]
