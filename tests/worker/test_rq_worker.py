"""A worker told to stop leaves promptly after its last job: its command thread (RQ's
pubsub listener, in a read of up to 60 s) must not hold the exit."""

from __future__ import annotations

import threading
import time
from typing import Any

from jobs.lib import queues
from jobs.worker.rq_worker import BatchWorker
from tests.factories import wait_for


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
