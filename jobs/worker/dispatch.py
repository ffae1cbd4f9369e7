"""The dispatcher thread: feeds the engine (JSON retries first, then the inbox), writes each
result to its shard's parts, and finishes a shard when its last result is written."""

from __future__ import annotations

import contextlib
import logging
import queue
from collections.abc import Iterator
from typing import TYPE_CHECKING

from engine.base import EngineRequest, EngineResult
from jobs.services import shards as shard_service
from jobs.wire import Code
from jobs.worker.db import with_db_retry
from jobs.worker.loop import Loop
from jobs.worker.parts import ShardWork, delete_stored, store_parts
from jobs.worker.retry import RETRY_SUFFIX, is_retry, needs_json_retry, retry_request
from jobs.worker.timings import timed

if TYPE_CHECKING:
    from jobs.worker.pipeline import Pipeline

log = logging.getLogger(__name__)
# Put in the inbox by Pipeline.close: the engine's request stream ends.
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

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline
        self.retries: queue.SimpleQueue[EngineRequest] = queue.SimpleQueue()
        super().__init__()

    def _requests(self) -> Iterator[EngineRequest]:
        # Retries come first: they are what keeps a shard from finishing. They never wait
        # for room in the inbox (the dispatcher that makes them also drains results); a
        # WAKE in the inbox says one is waiting, so an idle worker blocks here for free.
        inbox = self.pipeline.inbox
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
            self.pipeline.inbox.put_nowait(WAKE)

    def _wanted(self, request: EngineRequest) -> bool:
        # A request of a shard dropped or being handed back while it waited in the inbox is
        # never computed: its next attempt computes it (and would count it twice).
        pipeline = self.pipeline
        shard_id, attempt, _ = parse_request_id(request.request_id)
        work = pipeline.works.get(shard_id)
        if work is not None and work.attempt == attempt:
            with work.lock:
                if not (work.dead or work.handing_back):
                    return True
                work.pending.pop(request.request_id, None)
        pipeline.idle.request_finished(request.request_id)
        return False

    def _loop(self) -> None:
        pipeline = self.pipeline
        try:
            for result in pipeline.engine.run(self._requests()):
                self.on_result(result)
        except BaseException as exc:
            log.exception("engine failed")
            pipeline.broken = exc
            pipeline.fail_all(f"engine failed: {type(exc).__name__}: {exc}")

    def on_result(self, result: EngineResult) -> None:
        pipeline = self.pipeline
        pipeline.idle.request_finished(result.request_id)
        shard_id, attempt, line = parse_request_id(result.request_id)
        work = pipeline.works.get(shard_id)
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
                                      pipeline.adapters.known(request.model),
                                      cache_salt=work.cache_salt)
                work.pending[retry.request_id] = request
                work.json_retries += 1
                pipeline.idle.request_started(retry.request_id)
                self._add_retry(retry)
            else:
                work.write_result(request, line, result)
            if is_retry(result.request_id):
                work.retries_answered += 1
            pipeline.checkpointer.notice(work.unsaved_results())
            finish_now = (work.all_submitted and not work.pending and not work.finishing
                          and not work.handing_back)
            work.finishing = work.finishing or finish_now
        if finish_now:
            self.finish(work)

    def finish(self, work: ShardWork) -> None:
        """Store the shard's parts and record it done, or fail the attempt if storing fails;
        a part is attached to the shard only if the attempt is still current."""
        stored: list[str] = []
        # No checkpoint may be half taken while the parts are stored, nor start after.
        work.checkpoint_lock.acquire()
        try:
            store_parts(work, stored)
            work.usage.engine_seconds += self.pipeline.idle.engine_seconds(
                work.attempt_key, take=True)
            with timed("finish"):
                finished = with_db_retry(lambda: shard_service.finish_shard(
                    shard_id=work.shard_id, attempt=work.attempt, output_part=stored[0],
                    error_part=stored[1], flags_part=stored[2], progress=work.progress,
                    flag_counts=work.flag_counts, json_retries=work.json_retries,
                    usage=work.usage))
            if finished:
                # The parts hold the checkpoint's results now (the row no longer names it).
                delete_stored(work.saved.storage_names())
            else:
                log.warning("shard %s attempt %d was taken over; discarding its results",
                            work.shard_id, work.attempt)
                delete_stored(stored)
        except Exception as exc:
            log.exception("could not store results of shard %s", work.shard_id)
            delete_stored(stored)
            reason = f"storing results failed: {type(exc).__name__}: {exc}"
            with_db_retry(lambda: shard_service.fail_shard(
                shard_id=work.shard_id, attempt=work.attempt, reason=reason))
        finally:
            work.checkpoint_lock.release()
            work.discard()
            self.pipeline.unregister(work)
