"""RQ's work loop of batchworker and controlworker: a worker told to stop leaves promptly
after its last job (its command thread, RQ's pubsub listener in a read of up to 60 s,
must not hold the exit); an idle loop asks what to do next; a Redis outage starts a new
loop instead of ending the process."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from jobs.lib import queues
from jobs.worker import rq_worker
from jobs.worker.presence import Presence
from jobs.worker.rq_worker import BatchWorker
from tests.factories import wait_for

# Its tests talk to Redis (those without the database too).
pytestmark = pytest.mark.redis


def test_unsubscribe_returns_at_once_when_the_listener_reads_the_reply_first() -> None:
    worker = BatchWorker([queues.queue(queues.CONTROL_QUEUE)], connection=queues.connection())
    worker.subscribe()
    pubsub, listener = worker.pubsub, worker.pubsub_thread
    assert pubsub is not None and listener is not None
    send_unsubscribe = pubsub.unsubscribe

    def unsubscribe_and_let_the_listener_read_the_reply(*args: Any) -> None:
        # The order that stalled a stopping worker for up to a minute: the listener reads
        # the UNSUBSCRIBE reply, finds itself still running, and reads again, before the
        # stopping thread goes on.
        send_unsubscribe(*args)
        wait_for(lambda: not pubsub.channels, timeout=5, every=0.01,
                 message="the listener to read the reply")
        time.sleep(0.2)

    pubsub.unsubscribe = unsubscribe_and_let_the_listener_read_the_reply  # type: ignore[method-assign]
    stopping = threading.Thread(target=worker.unsubscribe, daemon=True)
    started = time.monotonic()
    stopping.start()
    stopping.join(timeout=10)
    assert not stopping.is_alive(), "unsubscribe waited on the listener's read"
    assert not listener.is_alive()
    assert time.monotonic() - started < 5


def _presence() -> Presence:
    return Presence(threading.Event(), every=60)


def test_an_idle_loop_asks_what_next_and_returns_its_answer() -> None:
    asked: list[float] = []

    def on_idle() -> str | None:
        asked.append(time.monotonic())
        return "switch" if len(asked) == 2 else None

    said: list[str] = []
    got = rq_worker.take_jobs([f"idle-{time.monotonic_ns()}"], name=f"idle.{time.time_ns()}",
                              presence=_presence(), say=said.append, on_idle=(1, on_idle))
    assert got == "switch"
    assert len(asked) == 2 and not said


def test_a_redis_outage_starts_a_new_loop_instead_of_ending(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Nothing listens on port 1: every loop fails to reach Redis (at once: no retries).
    down = redis.Redis(host="127.0.0.1", port=1, retry=Retry(NoBackoff(), 0))
    monkeypatch.setattr(queues, "connection", lambda: down)
    monkeypatch.setattr(rq_worker.time, "sleep", lambda seconds: None)
    loops = iter([True, True, False])
    said: list[str] = []
    presence = _presence()
    got = rq_worker.take_jobs(["control"], name="outage", presence=presence, say=said.append,
                              running=lambda: next(loops))
    assert got is None
    assert [text.split(" (")[0] for text in said] == [
        "Redis unavailable", "reconnecting to Redis"] * 2
    assert presence.worker is None
