"""The engine pipeline of a `batchworker` process.

The engine is loaded once per process and fed continuously: an RQ job (`run_shard`) claims
a shard, streams its lines into a bounded inbox and returns as soon as the last line is
handed in, so the worker takes the next shard while the engine still finishes this one's
slowest requests. One dispatcher thread drains the engine's results and writes each to its
shard's part files; the shard is recorded done when its last result is written. A heartbeat
thread keeps claimed shards alive in the database, stops shards whose batch was cancelled or
expired, and runs the reconciler.

Only ids cross threads and processes; the engine never sees a Django object.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TypeVar

from django.conf import settings
from django.core.files import File as DjangoFile
from django.core.files.storage import default_storage
from django.db import InterfaceError, OperationalError, close_old_connections, connection

from engine.base import CHAT, Engine, EngineRequest, EngineResult
from jobs.models import ContentRule, RequestCopy, ScreenedLine, Shard
from jobs.policy import VIOLATION, Violation
from jobs.quality import flags_for, json_problem, output_texts, wants_json
from jobs.services import shards as shard_service
from jobs.services.cleanup import sweep_temp_dir
from jobs.services.files import open_range_lines, temp_dir
from jobs.services.reconcile import reconcile
from jobs.services.shard_input import shard_last_line
from jobs.services.shards import Progress
from jobs.services.stopping import STOP_MESSAGES
from jobs.wire import failure_line, response_line, usage_of

log = logging.getLogger(__name__)
T = TypeVar("T")
_END = object()
_PIPELINE: Pipeline | None = None


def current_pipeline() -> Pipeline:
    if _PIPELINE is None:
        raise RuntimeError("run_shard runs only inside `manage.py batchworker`.")
    return _PIPELINE


def with_db_retry(fn: Callable[[], T], *, attempts: int = 5) -> T:
    """Run a database call, reconnecting if the connection was dropped (PostgreSQL
    restarted, backend terminated). Each call is one conditional write, safe to repeat."""
    for attempt in range(attempts):
        try:
            return fn()
        except (OperationalError, InterfaceError):
            if attempt == attempts - 1:
                raise
            log.warning("database connection lost; reconnecting", exc_info=True)
            connection.close()
            time.sleep(min(2**attempt, 10))
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class Pending:
    custom_id: str
    url: str
    body: dict[str, Any]


@dataclass
class ShardWork:
    """One claimed shard while its requests are in the engine."""

    shard_id: str
    attempt: int
    batch_id: str
    out_path: Path
    err_path: Path
    out: IO[bytes]
    err: IO[bytes]
    # Primary line -> custom_ids of the identical requests it answers for (dedup).
    copies: dict[int, list[str]]
    # Lines in this shard's range that are copies answered by another line.
    skip: set[int]
    # Lines a `skip` content rule kept from running -> the error message they get.
    screened: dict[int, str]
    # Local file of quality flags: one {"custom_id", "flags"} line per flagged request.
    flags_path: Path
    flags: IO[bytes]
    # request_id -> the request, while it is in the engine.
    pending: dict[str, Pending] = field(default_factory=dict)
    progress: Progress = field(default_factory=Progress)
    flag_counts: dict[str, int] = field(default_factory=dict)
    json_retries: int = 0
    all_submitted: bool = False
    finishing: bool = False
    dead: bool = False
    stop_code: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def request_id(self, line: int) -> str:
        return f"{self.shard_id}:{self.attempt}:{line}"

    def write_result(self, request: Pending, line: int, result: EngineResult) -> None:
        # Called with the lock held. Copies get the same body under their own custom_id;
        # only the computed request's tokens are counted (the copies cost nothing).
        ok = result.status_code == 200
        target = self.out if ok else self.err
        flags = flags_for(request.url, request.body, result.body) if ok else []
        for cid in [request.custom_id, *self.copies.get(line, ())]:
            target.write(response_line(cid, result.status_code, result.body))
            if ok:
                self.progress.completed += 1
            else:
                self.progress.failed += 1
            if flags:
                self.flags.write(json.dumps({"custom_id": cid, "flags": flags}).encode() + b"\n")
                for flag in flags:
                    self.flag_counts[flag] = self.flag_counts.get(flag, 0) + 1
        if ok:
            tokens_in, tokens_out = usage_of(result.body)
            self.progress.input_tokens += tokens_in
            self.progress.output_tokens += tokens_out

    def write_unrun(self, custom_id: str, line: int, code: str) -> None:
        self.write_failure(custom_id, line, code,
                           STOP_MESSAGES.get(code, "The request was not run."))

    def write_failure(self, custom_id: str, line: int, code: str, message: str) -> None:
        for cid in [custom_id, *self.copies.get(line, ())]:
            self.err.write(failure_line(cid, code, message))
            self.progress.failed += 1

    def close_files(self) -> None:
        for handle in (self.out, self.err, self.flags):
            if not handle.closed:
                handle.close()

    def remove_files(self) -> None:
        # The attempt's files are discarded: a last flush that fails (disk full) does not
        # matter. A close that raises still closes its handle, so retrying closes the rest.
        for _ in range(4):
            try:
                self.close_files()
                break
            except OSError:
                continue
        for path in (self.out_path, self.err_path, self.flags_path):
            path.unlink(missing_ok=True)


class Pipeline:
    def __init__(self, engine: Engine, *, worker_name: str, inbox_size: int = 64,
                 reconcile_every: float | None = None) -> None:
        self.engine = engine
        self.worker_name = worker_name
        self.inbox: queue.Queue[Any] = queue.Queue(maxsize=inbox_size)
        self.retries: queue.SimpleQueue[EngineRequest] = queue.SimpleQueue()
        self.works: dict[str, ShardWork] = {}
        self.works_lock = threading.Lock()
        self.broken: BaseException | None = None
        self.closing = threading.Event()
        self.idle = IdleMeter()
        conf = settings.BATCHWEB
        self.heartbeat_every = conf["HEARTBEAT_SECONDS"]
        self.reconcile_every = (conf["RECONCILE_SECONDS"] if reconcile_every is None
                                else reconcile_every)
        self.dispatcher = threading.Thread(target=self._dispatch, name="dispatch", daemon=True)
        self.heartbeater = threading.Thread(target=self._heartbeat, name="heartbeat",
                                            daemon=True)

    # --- lifecycle ---

    def start(self) -> None:
        global _PIPELINE
        _PIPELINE = self
        self.dispatcher.start()
        self.heartbeater.start()

    def drain(self, timeout: float) -> None:
        """Wait for the shards in flight to finish; hand back what is left at the timeout."""
        deadline = time.monotonic() + timeout
        while self.works and time.monotonic() < deadline and self.broken is None:
            time.sleep(0.2)
        self.hand_back_all()

    def hand_back_all(self) -> None:
        with self.works_lock:
            works = list(self.works.values())
        for work in works:
            self._drop(work)
            with_db_retry(lambda w=work: shard_service.release_shard(
                shard_id=w.shard_id, attempt=w.attempt))
            log.info("handed back shard %s", work.shard_id)

    def close(self) -> None:
        global _PIPELINE
        log.info("engine idle %.2f%% of %.1fs with work (%d requests)",
                 100 * self.idle.fraction(), self.idle.window(), self.idle.requests)
        self.closing.set()
        self.inbox.put(_END)
        self.dispatcher.join(timeout=30)
        self.heartbeater.join(timeout=30)
        self.engine.close()
        _PIPELINE = None

    # --- the RQ job side ---

    def run_shard(self, shard_id: str) -> None:
        """Claim a shard and stream its requests into the engine; returns once all are
        handed in (the dispatcher finishes the shard)."""
        if self.broken is not None:
            raise RuntimeError(f"engine failed: {self.broken}")
        close_old_connections()
        shard = with_db_retry(lambda: shard_service.claim_shard(shard_id=shard_id,
                                                                worker=self.worker_name))
        if shard is None:
            return
        # Only reads before it opens the part files: safe to repeat on a dropped connection.
        work = with_db_retry(lambda: self._open_work(shard))
        try:
            self._submit_lines(shard, work)
        except BaseException as exc:
            # Reading the input or the database failed, or a cold shutdown: the attempt is
            # lost, the shard goes back to the queue (with backoff).
            self._drop(work)
            if not isinstance(exc, SystemExit | KeyboardInterrupt):
                log.exception("shard %s failed while submitting", shard_id)
                reason = f"{type(exc).__name__}: {exc}"
                with_db_retry(lambda: shard_service.fail_shard(
                    shard_id=shard_id, attempt=work.attempt, reason=reason))
            raise
        with work.lock:
            work.all_submitted = True
            finish_now = not work.pending and not work.finishing and not work.dead
            work.finishing = work.finishing or finish_now
        if finish_now:
            self._finish(work)
        self._wait_for_room()

    def _wait_for_room(self) -> None:
        # The RQ job returns, and this worker takes its next shard, only once the engine's
        # batch has room: a worker with a full batch leaves the next shard to an idle
        # worker (measured by bench/scale_out.py), yet its own next shard arrives while the
        # batch is still nearly full, so the engine does not run dry between shards.
        while (self.idle.in_flight >= self.engine.batch_size and self.broken is None
               and not self.closing.is_set()):
            time.sleep(0.02)

    def _open_work(self, shard: Shard) -> ShardWork:
        last_line = shard_last_line(shard)
        copies: dict[int, list[str]] = {}
        for primary, custom_id in RequestCopy.objects.filter(
                batch_id=shard.batch_id, primary_line__gte=shard.first_line,
                primary_line__lte=last_line).values_list("primary_line", "custom_id").iterator():
            copies.setdefault(primary, []).append(custom_id)
        skip = set(RequestCopy.objects.filter(
            batch_id=shard.batch_id, line__gte=shard.first_line, line__lte=last_line
        ).values_list("line", flat=True))
        reasons = dict(ContentRule.objects.values_list("name", "reason"))
        screened = {
            line: Violation(rule=rule, action="skip", reason=reasons.get(rule, "")).message
            for line, rule in ScreenedLine.objects.filter(
                batch_id=shard.batch_id, line__gte=shard.first_line, line__lte=last_line
            ).values_list("line", "rule")}
        base = temp_dir() / f"{shard.id}-{shard.attempt}"
        out_path, err_path = base.with_suffix(".out"), base.with_suffix(".err")
        flags_path = base.with_suffix(".flags")
        # Closed by ShardWork.close_files when the shard finishes or is dropped.
        work = ShardWork(shard_id=shard.id, attempt=shard.attempt, batch_id=shard.batch_id,
                         out_path=out_path, err_path=err_path,
                         out=open(out_path, "wb"),  # noqa: SIM115
                         err=open(err_path, "wb"),  # noqa: SIM115
                         flags_path=flags_path,
                         flags=open(flags_path, "wb"),  # noqa: SIM115
                         copies=copies, skip=skip, screened=screened)
        with self.works_lock:
            self.works[shard.id] = work
        return work

    def _submit_lines(self, shard: Shard, work: ShardWork) -> None:
        storage_name = shard.batch.input_file.storage_name
        with open_range_lines(storage_name, start=shard.start_byte, end=shard.end_byte,
                              first_number=shard.first_line) as lines:
            for line in lines:
                if line.content is None or not line.content.strip() or line.number in work.skip:
                    continue
                request = json.loads(line.content)
                if work.dead:
                    return
                if work.stop_code:
                    with work.lock:
                        work.write_unrun(request["custom_id"], line.number, work.stop_code)
                    continue
                if line.number in work.screened:
                    with work.lock:
                        work.write_failure(request["custom_id"], line.number, VIOLATION,
                                           work.screened[line.number])
                    continue
                engine_request = EngineRequest(request_id=work.request_id(line.number),
                                               url=request["url"], body=request["body"])
                with work.lock:
                    work.pending[engine_request.request_id] = Pending(
                        request["custom_id"], request["url"], request["body"])
                self._put(engine_request)

    def _put(self, request: EngineRequest) -> None:
        # Blocks while the engine is full: this is the backpressure that bounds memory.
        # Counted before it goes in, so its result can never be counted first.
        self.idle.request_started()
        while True:
            if self.broken is not None:
                raise RuntimeError(f"engine failed: {self.broken}")
            try:
                self.inbox.put(request, timeout=0.5)
                return
            except queue.Full:
                continue

    # --- the dispatcher thread ---

    def _requests(self) -> Iterator[EngineRequest]:
        # Retries come first: they are what keeps a shard from finishing. They never wait
        # for room in the inbox (the dispatcher that makes them also drains results).
        while True:
            try:
                yield self.retries.get_nowait()
                continue
            except queue.Empty:
                pass
            try:
                item = self.inbox.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is _END:
                return
            yield item

    def _dispatch(self) -> None:
        try:
            for result in self.engine.run(self._requests()):
                try:
                    self._on_result(result)
                except OSError as exc:
                    self._write_failed(result, exc)
        except BaseException as exc:
            log.exception("engine failed")
            self.broken = exc
            self._fail_all(f"engine failed: {type(exc).__name__}: {exc}")

    def _on_result(self, result: EngineResult) -> None:
        self.idle.request_finished()
        shard_id, attempt, line_part = result.request_id.rsplit(":", 2)
        line = int(line_part.rstrip(RETRY_SUFFIX))
        work = self.works.get(shard_id)
        if work is None or work.attempt != int(attempt):
            return
        with work.lock:
            request = work.pending.pop(result.request_id, None)
            if request is None or work.dead:
                return
            if result.aborted:
                work.write_unrun(request.custom_id, line, work.stop_code or "request_aborted")
            elif not line_part.endswith(RETRY_SUFFIX) and needs_json_retry(request, result):
                # Seed 003: a structured output that does not parse is run once more (with
                # a new seed); only the final attempt is written.
                retry = EngineRequest(request_id=result.request_id + RETRY_SUFFIX,
                                      url=request.url, body=reseeded(request.body))
                work.pending[retry.request_id] = request
                work.json_retries += 1
                self.idle.request_started()
                self.retries.put(retry)
            else:
                work.write_result(request, line, result)
            finish_now = work.all_submitted and not work.pending and not work.finishing
            work.finishing = work.finishing or finish_now
        if finish_now:
            self._finish(work)

    def _write_failed(self, result: EngineResult, exc: OSError) -> None:
        """A shard's part file could not be written (disk full, I/O error): that attempt
        fails and is retried; the engine and the other shards carry on."""
        work = self.works.get(result.request_id.rsplit(":", 2)[0])
        if work is None:
            return
        reason = f"writing results failed: {type(exc).__name__}: {exc}"
        log.error("shard %s: %s", work.shard_id, reason)
        self._drop(work)
        try:
            with_db_retry(lambda: shard_service.fail_shard(
                shard_id=work.shard_id, attempt=work.attempt, reason=reason))
        except Exception:
            log.exception("could not record failure of shard %s", work.shard_id)

    def _finish(self, work: ShardWork) -> None:
        """Store the shard's parts and record it done, or fail the attempt if storing fails;
        a part is attached to the shard only if the attempt is still current."""
        stored: list[str] = []
        try:
            work.close_files()
            for path, kind in ((work.out_path, "output"), (work.err_path, "error"),
                               (work.flags_path, "flags")):
                if path.stat().st_size == 0:
                    stored.append("")
                    continue
                with open(path, "rb") as handle:
                    stored.append(default_storage.save(
                        f"parts/{work.batch_id}/{work.shard_id}-{work.attempt}.{kind}.jsonl",
                        DjangoFile(handle)))
            finished = with_db_retry(lambda: shard_service.finish_shard(
                shard_id=work.shard_id, attempt=work.attempt, output_part=stored[0],
                error_part=stored[1], flags_part=stored[2], progress=work.progress,
                flag_counts=work.flag_counts, json_retries=work.json_retries))
            if not finished:
                log.warning("shard %s attempt %d was taken over; discarding its results",
                            work.shard_id, work.attempt)
                _delete_all(stored)
        except Exception as exc:
            log.exception("could not store results of shard %s", work.shard_id)
            _delete_all(stored)
            reason = f"storing results failed: {type(exc).__name__}: {exc}"
            with_db_retry(lambda: shard_service.fail_shard(
                shard_id=work.shard_id, attempt=work.attempt, reason=reason))
        finally:
            work.remove_files()
            with self.works_lock:
                self.works.pop(work.shard_id, None)

    def _drop(self, work: ShardWork) -> None:
        """Forget a shard's attempt: abort its requests in the engine, discard its files."""
        with work.lock:
            work.dead = True
            in_flight = list(work.pending)
            work.pending.clear()
        if in_flight:
            self.engine.abort(in_flight)
        work.remove_files()
        with self.works_lock:
            self.works.pop(work.shard_id, None)

    def _fail_all(self, reason: str) -> None:
        with self.works_lock:
            works = list(self.works.values())
        for work in works:
            self._drop(work)
            try:
                with_db_retry(lambda w=work: shard_service.fail_shard(
                    shard_id=w.shard_id, attempt=w.attempt, reason=reason))
            except Exception:
                log.exception("could not record failure of shard %s", work.shard_id)

    # --- the heartbeat thread ---

    def _heartbeat(self) -> None:
        last_reconcile = 0.0
        last_sweep = time.monotonic()  # the worker swept TMP_DIR as it started
        sweep_every = settings.BATCHWEB["CLEANUP_INTERVAL_SECONDS"]
        while not self.closing.wait(self.heartbeat_every):
            try:
                self._beat()
                if self.reconcile_every and time.monotonic() - last_reconcile > \
                        self.reconcile_every:
                    last_reconcile = time.monotonic()
                    reconcile()
                if sweep_every > 0 and time.monotonic() - last_sweep > sweep_every:
                    last_sweep = time.monotonic()
                    sweep_temp_dir()  # TMP_DIR is this machine's: every worker sweeps it
            except (OperationalError, InterfaceError):
                log.warning("heartbeat: database unavailable; will retry", exc_info=True)
                connection.close()
            except Exception:
                log.exception("heartbeat failed")
        connection.close()

    def _beat(self) -> None:
        with self.works_lock:
            works = list(self.works.values())
        for work in works:
            with work.lock:
                snapshot = Progress(**work.progress.as_fields())
            mine, stop_code = shard_service.heartbeat(shard_id=work.shard_id,
                                                      attempt=work.attempt, progress=snapshot)
            if not mine and not work.finishing:
                log.warning("shard %s is no longer ours; dropping it", work.shard_id)
                self._drop(work)
            elif stop_code and not work.stop_code:
                with work.lock:
                    work.stop_code = stop_code
                    in_flight = list(work.pending)
                log.info("shard %s stopping: %s", work.shard_id, stop_code)
                self.engine.abort(in_flight)


class IdleMeter:
    """How long the engine had nothing to do while this worker had work: the time with no
    request in flight, between the first request handed in and the last result out.
    Reported when the worker stops (the benchmarks read it)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.in_flight = 0
        self.requests = 0
        self.first: float | None = None
        self.last = 0.0
        self.idle_since: float | None = None
        self.idle_total = 0.0

    def request_started(self) -> None:
        now = time.monotonic()
        with self.lock:
            if self.first is None:
                self.first = now
            if self.in_flight == 0 and self.idle_since is not None:
                self.idle_total += now - self.idle_since
                self.idle_since = None
            self.in_flight += 1
            self.requests += 1

    def request_finished(self) -> None:
        now = time.monotonic()
        with self.lock:
            self.in_flight = max(0, self.in_flight - 1)
            self.last = now
            if self.in_flight == 0:
                self.idle_since = now

    def window(self) -> float:
        return (self.last - self.first) if self.first is not None else 0.0

    def fraction(self) -> float:
        window = self.window()
        return self.idle_total / window if window > 0 else 0.0


RETRY_SUFFIX = "r"


def needs_json_retry(request: Pending, result: EngineResult) -> bool:
    if result.status_code != 200 or request.url != CHAT:
        return False
    response_format = wants_json(request.body)
    if response_format is None:
        return False
    return any(json_problem(text, response_format)
               for text, _ in output_texts(request.url, result.body))


def reseeded(body: dict[str, Any]) -> dict[str, Any]:
    seed = body.get("seed")
    return {**body, "seed": (seed + 1) if isinstance(seed, int) else 1}


def _delete_all(names: list[str]) -> None:
    for name in names:
        if name:
            try:
                default_storage.delete(name)
            except Exception:
                log.exception("could not delete %s", name)
