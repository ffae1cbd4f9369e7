"""The RQ worker class batchworker runs: rq's SimpleWorker (jobs run in this process,
beside the loaded engine) with a shutdown that does not stall."""

from __future__ import annotations

from rq import SimpleWorker

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
