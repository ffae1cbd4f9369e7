"""RQ's work loop as `batchworker` and `controlworker` run it: rq's SimpleWorker (jobs run
in this process, beside a loaded engine) with a shutdown that does not stall, started
again after a Redis outage."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import redis
from django.conf import settings
from rq import SimpleWorker

from jobs.lib import queues
from jobs.worker.presence import Presence

T = TypeVar("T")

# How long a stopping worker waits for its command thread (RQ's own bound).
PUBSUB_JOIN_SECONDS = 1.0


class BatchWorker(SimpleWorker):
    def unsubscribe(self) -> None:
        """Stop the thread that listens for RQ's worker commands, promptly.

        RQ sends UNSUBSCRIBE and then stops the thread, counting on the reply to wake the
        thread's read (of up to 60 s). When the thread reads that reply before the stop
        flag is set, it starts another 60 s read, and redis-py 8's stop() waits for the
        thread to end: a worker told to stop then took up to a minute to exit after its
        last job. Setting the flag first closes that gap: whichever read gets the reply
        ends the loop."""
        thread, pubsub = self.pubsub_thread, self.pubsub
        if thread is None or pubsub is None:
            return
        self.log.info("Worker %s: unsubscribing from channel %s", self.name,
                      self.pubsub_channel_name)
        thread.stop(timeout=0)  # the flag only: the thread is still in its read
        pubsub.unsubscribe()
        thread.join(timeout=PUBSUB_JOIN_SECONDS)
        pubsub.close()


def take_jobs(queue_names: list[str], *, name: str, presence: Presence,
              say: Callable[[str], None], host: str = "",
              on_idle: tuple[int, Callable[[], T | None]] | None = None,
              running: Callable[[], bool] = lambda: True) -> T | None:
    """Run RQ's work loop until a stop is requested (SIGTERM / SIGINT: None), riding out
    Redis outages: RQ's loop returns when Redis goes away, and a worker's process (with
    its loaded engine) outlives that, so a new loop starts once Redis answers again.
    `say` reports an outage.

    With `on_idle` (seconds, ask), RQ's loop also returns after that many seconds without
    a job, and `ask()` is called: what it returns ends the loop with it (batchworker's
    model to switch to), None goes on. `running()` false ends it too (a broken engine)."""
    idle_check, ask = on_idle or (None, None)
    loops = 0
    while running():
        worker = None
        redis_failed = False
        try:
            # A fresh name per loop: the last loop's registration may still be in Redis.
            worker = BatchWorker([queues.queue(q) for q in queue_names],
                                 name=f"{name}.{loops}" if loops else name,
                                 connection=queues.connection())
            if host:
                worker.hostname = host  # registered with the worker (RQ's own field)
            presence.worker = worker
            presence.report(worker)
            worker.work(logging_level=settings.LOG_LEVEL, max_idle_time=idle_check)
        except redis.exceptions.RedisError as exc:
            # Building the worker and RQ's own shutdown talk to Redis too.
            redis_failed = True
            say(f"Redis unavailable ({exc})")
        finally:
            presence.worker = None
        loops += 1
        if worker is not None and worker._shutdown_requested_date is not None:
            return None
        if ask is not None and not redis_failed:
            due = ask()
            if due is not None:
                return due
            continue
        time.sleep(2)
        say("reconnecting to Redis")
    return None
