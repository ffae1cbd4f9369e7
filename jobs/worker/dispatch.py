"""The dispatcher thread: feeds the engine (JSON retries first, then the inbox), writes each
result to its shard's parts, and finishes a shard when its last result is written."""

from __future__ import annotations

import contextlib
import logging
import queue
from collections.abc import Callable, Iterator

from engine.base import EngineRequest, EngineResult
from engine.endpoints import usage_of
from jobs.formats.prompts import output_room
from jobs.formats.wire import Code
from jobs.worker.adapters import AdapterFolders
from jobs.worker.db import ShardStore
from jobs.worker.finish import finish
from jobs.worker.loop import Loop
from jobs.worker.retry import RETRY_SUFFIX, is_retry, needs_json_retry, retry_request
from jobs.worker.state import WorkerState

log = logging.getLogger(__name__)
# Put in the inbox as the dispatcher is joined: the engine's request stream ends.
END = object()
# Put in the inbox with a JSON retry: wakes the engine's request stream to take it.
WAKE = object()


def parse_request_id(request_id: str) -> tuple[str, int, int]:
    """(shard id, attempt, line) of a request id made by ShardWork.request_id, with or
    without the JSON retry's suffix."""
    shard_id, attempt, line_part = request_id.rsplit(":", 2)
    return shard_id, int(attempt), int(line_part.rstrip(RETRY_SUFFIX))


class Dispatcher(Loop):
    name = "dispatch"

    def __init__(self, state: WorkerState, *, store: ShardStore, adapters: AdapterFolders,
                 notice_unsaved: Callable[[int], None]) -> None:
        self.state = state
        self.store = store
        self.adapters = adapters
        # Told each shard's unsaved result count after each result (the checkpointer's).
        self.notice_unsaved = notice_unsaved
        self.retries: queue.SimpleQueue[EngineRequest] = queue.SimpleQueue()
        super().__init__()

    def join(self, timeout: float) -> None:
        self.state.inbox.put(END)
        super().join(timeout)

    def _requests(self) -> Iterator[EngineRequest]:
        # Retries come first: they are what keeps a shard from finishing. They never wait
        # for room in the inbox (the dispatcher that makes them also drains results); a
        # WAKE in the inbox says one is waiting, so an idle worker blocks here for free.
        inbox = self.state.inbox
        while True:
            try:
                item = self.retries.get_nowait()
            except queue.Empty:
                item = inbox.get()
            if item is END:
                return
            if item is WAKE:
                continue
            if self._wanted(item):
                yield item

    def _add_retry(self, request: EngineRequest) -> None:
        self.retries.put(request)
        # A full inbox has requests: the retry is taken before the next of them.
        with contextlib.suppress(queue.Full):
            self.state.inbox.put_nowait(WAKE)

    def _wanted(self, request: EngineRequest) -> bool:
        # A request of a shard dropped or being handed back while it waited in the inbox is
        # never computed: its next attempt computes it (and would count it twice).
        state = self.state
        shard_id, attempt, _ = parse_request_id(request.request_id)
        work = state.works.get(shard_id)
        if work is not None and work.attempt == attempt:
            with work.lock:
                if not work.stopped:
                    return True
                work.pending.pop(request.request_id, None)
        state.idle.request_finished(request.request_id)
        return False

    def _loop(self) -> None:
        state = self.state
        try:
            for result in state.engine.run(self._requests()):
                self.on_result(result)
        except BaseException as exc:
            log.exception("engine failed")
            state.broken = exc
            self._fail_all(f"engine failed: {type(exc).__name__}: {exc}")

    def _fail_all(self, reason: str) -> None:
        for work in self.state.current_works():
            self.state.drop(work)
            try:
                self.store.fail(work, reason)
            except Exception:
                log.exception("could not record failure of shard %s", work.shard_id)

    def on_result(self, result: EngineResult) -> None:
        state = self.state
        state.idle.request_finished(result.request_id)
        shard_id, attempt, line = parse_request_id(result.request_id)
        work = state.works.get(shard_id)
        if work is None or work.attempt != attempt:
            return
        with work.lock:
            request = work.pending.pop(result.request_id, None)
            if request is None or work.dead:
                return
            if result.aborted and work.handing_back:
                return  # not run: the next attempt runs it
            if result.aborted:
                work.write_unrun(request.custom_id, line, work.stop_code or Code.REQUEST_ABORTED)
            elif not is_retry(result.request_id) and needs_json_retry(request, result):
                retry = retry_request(result.request_id, request,
                                      self.adapters.known(request.model),
                                      cache_salt=work.cache_salt,
                                      output_room=output_room(request, work.room))
                work.pending[retry.request_id] = request
                work.json_retries += 1
                state.idle.request_started(retry.request_id)
                self._add_retry(retry)
            else:
                work.write_result(request, line, result)
                if result.status_code == 200:
                    prompt, output, _ = usage_of(request.url, result.body)
                    state.idle.count_tokens(prompt, output)
            if is_retry(result.request_id):
                work.retries_answered += 1
            self.notice_unsaved(work.unsaved_results())
            finish_now = work.claim_finish()
        if finish_now:
            finish(self.state, work, store=self.store)
