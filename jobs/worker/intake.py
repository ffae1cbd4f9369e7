"""The RQ job side: claim a shard and stream its lines into the engine's inbox; return once
all are handed in and the engine's batch has room (the dispatcher finishes the shard).
`jobs.tasks.run_shard` hands its shard to the process's running intake (`current_intake`)."""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable

from engine.base import EngineRequest
from jobs.models import Shard
from jobs.services.shard_input import shard_requests
from jobs.storage.external import ObjectChanged, shown_reason
from jobs.worker.db import ShardStore
from jobs.worker.finish import finish
from jobs.worker.served import Served
from jobs.worker.state import WorkerState
from jobs.worker.work import ShardWork

log = logging.getLogger(__name__)
# The intake of this process's running pipeline: where the RQ job hands its shard.
_CURRENT: Intake | None = None


def current_intake() -> Intake:
    if _CURRENT is None:
        raise RuntimeError("run_shard runs only inside `manage.py batchworker`.")
    return _CURRENT


class Intake:
    def __init__(self, state: WorkerState, *, store: ShardStore, served: Served,
                 top_up: Callable[[str], None]) -> None:
        self.state = state
        self.store = store
        self.served = served
        # Called with the batch of each claimed shard: its next shards go to Redis.
        self.top_up = top_up

    def start(self) -> None:
        """Take the RQ job's shards from now on."""
        global _CURRENT
        _CURRENT = self

    def stop(self) -> None:
        global _CURRENT
        _CURRENT = None

    def run_shard(self, shard_id: str) -> None:
        """Claim a shard and stream its requests into the engine; returns once all are
        handed in (the dispatcher finishes the shard)."""
        state = self.state
        if state.broken is not None:
            raise RuntimeError(f"engine failed: {state.broken}")
        shard = self.store.claim(shard_id)
        if shard is None:
            return
        self.top_up(shard.batch_id)
        work = self.store.open(shard)
        if work.adopted:
            log.info("shard %s attempt %d adopts %d results of attempt %d", shard_id,
                     work.attempt, len(work.adopted), work.saved.attempt)
        state.register(work)
        try:
            self.served.claimed(shard)  # provenance, and the eval runs it starts
            all_in = self._submit_lines(shard, work)
        except BaseException as exc:
            # Reading the input or the database failed, or a cold shutdown: the attempt is
            # lost, the shard goes back to the queue (with backoff).
            state.drop(work)
            if not isinstance(exc, SystemExit | KeyboardInterrupt):
                log.exception("shard %s failed while submitting", shard_id)
                # The reason ends up in the users' error lines: never the storage's
                # address (the log above has it).
                self.store.fail(work, shown_reason(exc),
                                input_changed=str(exc) if isinstance(exc, ObjectChanged)
                                else "")
            raise
        if not all_in:
            # Dropped, handed back, or the worker closed: the shard is not this attempt's to
            # finish, and its lines not handed in must not count as answered.
            return
        with work.lock:
            work.all_submitted = True
            finish_now = work.claim_finish()
        if finish_now:
            finish(state, work, store=self.store)
        self._wait_for_room()

    def _wait_for_room(self) -> None:
        # The RQ job returns, and this worker takes its next shard, only once the engine's
        # batch has room: a worker with a full batch leaves the next shard to an idle
        # worker (measured by bench/scale_out.py), yet its own next shard arrives while the
        # batch is still nearly full, so the engine does not run dry between shards.
        state = self.state
        while (not state.idle.wait_for_room(state.engine.batch_size, timeout=0.5)
               and state.broken is None and not state.closing.is_set()):
            pass

    def _submit_lines(self, shard: Shard, work: ShardWork) -> bool:
        """Hand the shard's lines in; False when its attempt stopped running first."""
        # A grouped shard's lines come in run order, a prefix group's requests next to each
        # other, each with its group's key: the engine has the group's first request
        # compute the prefix before the rest, which then find it in its prefix cache.
        grouped = shard.lines_from is not None
        with shard_requests(shard, skip=work.skip | work.adopted,
                            records=work.records) as requests:
            for number, line in work.lines_to_run(requests):
                adapter_path = self.served.adapter_folder(shard, work, line.model)
                request = work.engine_request(number, line, adapter_path=adapter_path,
                                              grouped=grouped)
                if request is not None and not self._put(request, work):
                    return False
        return not work.stopped

    def _put(self, request: EngineRequest, work: ShardWork) -> bool:
        """Hand a request to the engine; False, not handed in (nor in flight any longer),
        when the attempt stops running (dropped, handed back) or the worker closes while it
        waits."""
        # Blocks while the engine is full: this is the backpressure that bounds memory.
        # Counted before it goes in, so its result can never be counted first.
        state = self.state
        state.idle.request_started(request.request_id)
        while True:
            if state.broken is not None:
                raise RuntimeError(f"engine failed: {state.broken}")
            if work.stopped or state.closing.is_set():
                with work.lock:
                    work.pending.pop(request.request_id, None)
                state.idle.request_finished(request.request_id)
                return False
            try:
                state.inbox.put(request, timeout=0.5)
                return True
            except queue.Full:
                continue
