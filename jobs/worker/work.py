"""A claimed shard while its requests are in the engine (`ShardWork`): what it answers for,
the requests it has in the engine, and its parts (output lines, error lines and quality
flags) with their counters. Nothing of a shard goes to local disk: each part is held in
memory only from one checkpoint to the next (`PartBuffer`); a checkpoint stores what was
written since the last one as a segment (jobs.worker.part_storage) and lets it go, so a
worker holds at most one checkpoint interval of results. The next attempt of an unfinished
shard adopts the segments its claim hands on (`ShardWork.adopt`).

Its state is memory only: it opens from what a claimed shard answers for
(jobs.services.shard_input.open_input), its row is written by jobs.worker.db and its parts
are stored by jobs.worker.part_storage."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from engine.base import EngineRequest, EngineResult
from engine.endpoints import reasoning_of, usage_of
from engine.prefix_limit import PrefixLimit
from jobs.formats.checkpoint_record import Checkpoint, Progress, ShardUsage
from jobs.formats.prefix_keys import prefix_key
from jobs.formats.prompts import Room, output_room
from jobs.formats.wire import Code, RequestLine, failure_line, response_line, unrun_message
from jobs.models import Shard
from jobs.policy.quality import flags_for
from jobs.services.shard_input import Screened, ShardInput


class PartBuffer:
    """One part of a shard attempt, in memory from its last checkpoint on. Offsets count
    every byte the attempt wrote to it; only those at or after `saved` are held."""

    def __init__(self) -> None:
        self.saved = 0  # bytes stored as segments (and released)
        self.held = bytearray()

    def write(self, data: bytes) -> None:
        self.held += data

    def tell(self) -> int:
        return self.saved + len(self.held)

    def between(self, start: int, end: int) -> bytes:
        """The bytes written between two offsets, both at or after the last release."""
        assert self.saved <= start <= end <= self.tell(), (self.saved, start, end)
        return bytes(self.held[start - self.saved:end - self.saved])

    def release(self, upto: int) -> None:
        """Let go of what a recorded checkpoint holds now."""
        del self.held[:upto - self.saved]
        self.saved = upto

    def discard(self) -> None:
        self.held = bytearray()


@dataclass
class ShardWork:
    """One claimed shard while its requests are in the engine."""

    shard_id: str
    attempt: int
    batch_id: str
    # Primary line -> custom_ids of the identical requests it answers for (dedup).
    copies: dict[int, list[str]]
    # Lines in this shard's range that are copies answered by another line.
    skip: set[int]
    # Lines validation kept from running -> the error line they get.
    screened: dict[int, Screened]
    # What the batch's model leaves each request's output: the limit the budget counted,
    # handed to the engine with the request (and with its JSON retry).
    room: Room
    # The batch's model: requests naming another (a LoRA adapter) are counted apart, for
    # the ledger.
    model: str = ""
    # The prefix cache salt of the batch owner's requests (shard_input.prefix_cache_salt).
    cache_salt: str = ""
    # A grouped shard's records of the line index: the lines it runs, read once at open.
    records: Any = None
    # The LoRA adapters its lines name, each resolved once per attempt (by the intake):
    # name -> its folder on this host, None when it is no longer registered.
    adapter_paths: dict[str, str | None] = field(default_factory=dict)
    out: PartBuffer = field(default_factory=PartBuffer)
    err: PartBuffer = field(default_factory=PartBuffer)
    # Quality flags: one {"custom_id", "flags"} line per flagged request.
    flags: PartBuffer = field(default_factory=PartBuffer)
    # request_id -> the request, while it is in the engine.
    pending: dict[str, RequestLine] = field(default_factory=dict)
    progress: Progress = field(default_factory=Progress)
    flag_counts: dict[str, int] = field(default_factory=dict)
    json_retries: int = 0
    # The adapters' counters, and the engine seconds of earlier attempts (adopted with
    # their checkpoint; this attempt's are the worker's IdleMeter's until it finishes).
    usage: ShardUsage = field(default_factory=ShardUsage)
    # The prompt blocks this attempt's requests computed, for the limit of prefix caching
    # (Progress.cacheable_tokens): a shard by itself, since another may run elsewhere.
    prefix_limit: PrefixLimit = field(default_factory=PrefixLimit)
    all_submitted: bool = False
    finishing: bool = False
    dead: bool = False
    # The worker is stopping: results still come in and are written, but the shard is
    # handed back (with a checkpoint of them) rather than finished.
    handing_back: bool = False
    stop_code: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)
    # --- resume ---
    # Lines whose results came with the adopted checkpoint: not run again.
    adopted: set[int] = field(default_factory=set)
    # Lines with a result written (adopted ones included).
    answered: set[int] = field(default_factory=set)
    # Results this attempt computed and wrote (a request's final run; copies not counted).
    computed: int = 0
    # JSON retries whose line has its result written, and those the adopted checkpoint
    # counted: what a checkpoint may claim (a retry still in flight is run again).
    retries_answered: int = 0
    adopted_json_retries: int = 0
    # The last checkpoint recorded on the row (or the adopted one; what of this attempt's
    # parts it covers is each PartBuffer.saved), its results it holds, and when it was taken.
    saved: Checkpoint = field(default_factory=Checkpoint)
    saved_computed: int = 0
    saved_at: float = field(default_factory=time.monotonic)
    # Held while a checkpoint is taken and while the shard finishes: never both at once.
    checkpoint_lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def opened(cls, shard: Shard, opened: ShardInput) -> ShardWork:
        """A claimed shard's work, from its input and the checkpoint its claim handed on."""
        work = cls(shard_id=shard.id, attempt=shard.attempt, batch_id=shard.batch_id,
                   copies=opened.copies, skip=opened.skip, screened=opened.screened,
                   room=opened.room, model=shard.batch.model, cache_salt=opened.cache_salt,
                   records=opened.records)
        work.adopt(opened.checkpoint)
        return work

    def request_id(self, line: int) -> str:
        return f"{self.shard_id}:{self.attempt}:{line}"

    @property
    def attempt_key(self) -> str:
        """What its request ids start with (IdleMeter's key for its engine time)."""
        return f"{self.shard_id}:{self.attempt}"

    @property
    def stopped(self) -> bool:
        """Dropped, or being handed back: no more of its requests go to the engine."""
        return self.dead or self.handing_back

    def unsaved_results(self) -> int:
        """Lines answered since the last checkpoint (with the lock held)."""
        return len(self.answered) - len(self.saved.lines)

    def claim_finish(self) -> bool:
        """With the lock held: whether every line is handed in and every result written,
        so the caller finishes the attempt (True once). A shard being handed back is never
        finished: its submission may have stopped early, and finishing it would drop the
        lines it never ran."""
        ready = (self.all_submitted and not self.pending and not self.finishing
                 and not self.stopped)
        self.finishing = self.finishing or ready
        return ready

    def write_result(self, request: RequestLine, line: int, result: EngineResult) -> None:
        self._write_result(request, line, result)
        self.answered.add(line)
        self.computed += 1

    def _write_result(self, request: RequestLine, line: int, result: EngineResult) -> None:
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
        # The engine ran it once, whatever its copies.
        if not ok:
            self.progress.ran_failed += 1
        else:
            self.progress.ran_ok += 1
            tokens_in, tokens_out, cached = usage_of(request.url, result.body)
            reasoning = reasoning_of(request.url, result.body)
            self.progress.input_tokens += tokens_in
            self.progress.output_tokens += tokens_out
            self.progress.cached_tokens += cached
            self.progress.reasoning_tokens += reasoning
            self.progress.cacheable_tokens += self.prefix_limit.add(tokens_in,
                                                                    result.prompt_blocks)
            if request.model != self.model:
                self.usage.add(request.model, requests=1 + len(self.copies.get(line, ())),
                               input_tokens=tokens_in, cached_tokens=cached,
                               output_tokens=tokens_out, reasoning_tokens=reasoning)

    def lines_to_run(self, requests: Iterable[tuple[int, dict[str, Any]]]
                     ) -> Iterator[tuple[int, RequestLine]]:
        """The lines of `requests` (line number, request object) that go to the engine;
        those that do not run get their error lines instead (`write_unrunnable`). Ends
        when the attempt stops running (dropped, handed back)."""
        for number, request in requests:
            if self.stopped:
                return
            with self.lock:
                # Before the line is read as a request: a refused one need not be one.
                if self.write_unrunnable(request["custom_id"], number):
                    continue
            yield number, RequestLine(request["custom_id"], request["url"], request["body"])

    def write_unrunnable(self, custom_id: str, line: int) -> bool:
        """With the lock held: write the error lines of a line this attempt will not run
        (its batch is stopping, or validation kept it from running). False for a line to
        run."""
        if self.stop_code:
            self.write_unrun(custom_id, line, self.stop_code)
        elif line in self.screened:
            self._write_errors(custom_id, line, self.screened[line].error_line)
        else:
            return False
        return True

    def write_unrun(self, custom_id: str, line: int, code: str) -> None:
        self.write_failure(custom_id, line, code, unrun_message(code))

    def write_failure(self, custom_id: str, line: int, code: str, message: str) -> None:
        self._write_errors(custom_id, line, lambda cid: failure_line(cid, code, message))

    def _write_errors(self, custom_id: str, line: int, error_line: Callable[[str], bytes]
                      ) -> None:
        # With the lock held: the line's error line under its custom_id and its copies'.
        for cid in [custom_id, *self.copies.get(line, ())]:
            self.err.write(error_line(cid))
            self.progress.failed += 1
        self.answered.add(line)

    def engine_request(self, line: int, request: RequestLine, *, adapter_path: str | None,
                       grouped: bool) -> EngineRequest | None:
        """The line's request as it goes into the engine, in flight (`pending`) from now
        on. `adapter_path`: the folder of the adapter it names ("" for the batch's model),
        None when that adapter is no longer registered: the line gets its error line
        instead, and no request. `grouped`: the shard runs a prefix group's requests next
        to each other, each with its group's key."""
        if adapter_path is None:
            with self.lock:
                self.write_failure(request.custom_id, line, Code.MODEL_NOT_FOUND,
                                   f"The adapter '{request.model}' of '{self.model}' is no "
                                   "longer registered.")
            return None
        key = prefix_key(request) if grouped else None
        engine_request = EngineRequest(request_id=self.request_id(line), url=request.url,
                                       body=request.body, adapter_path=adapter_path,
                                       cache_salt=self.cache_salt,
                                       prefix=(key.digest or 1) if key else 0,
                                       # The output limit the budget counted.
                                       output_room=output_room(request, self.room))
        with self.lock:
            self.pending[engine_request.request_id] = request
        return engine_request

    def parts(self) -> tuple[PartBuffer, PartBuffer, PartBuffer]:
        return self.out, self.err, self.flags

    def saved_offsets(self) -> tuple[int, int, int]:
        """Where each part's bytes not yet in a checkpoint segment begin."""
        out, err, flags = (part.saved for part in self.parts())
        return out, err, flags

    def snapshot(self) -> tuple[Checkpoint, tuple[int, int, int], int]:
        """With the lock held: (what a checkpoint taken now holds, without its segments; the
        offsets in the parts it covers; this attempt's computed results it holds)."""
        out_size, err_size, flags_size = (part.tell() for part in self.parts())
        return (Checkpoint(attempt=self.attempt, lines=set(self.answered),
                           progress=Progress(**self.progress.as_fields()),
                           flag_counts=dict(self.flag_counts),
                           json_retries=self.adopted_json_retries + self.retries_answered,
                           usage=self.usage.copy()),
                (out_size, err_size, flags_size), self.computed)

    def mark_saved(self, checkpoint: Checkpoint, sizes: tuple[int, int, int],
                   computed: int) -> None:
        """With the lock held: `checkpoint` is recorded; what it covers leaves memory."""
        for part, upto in zip(self.parts(), sizes, strict=True):
            part.release(upto)
        self.saved = checkpoint
        self.saved_computed = computed
        self.saved_at = time.monotonic()

    def discard(self) -> None:
        """The attempt's unsaved results are thrown away (it was dropped or has finished)."""
        for part in self.parts():
            part.discard()

    def adopt(self, checkpoint: Checkpoint) -> bool:
        """Start from the checkpoint the claim handed on (its segments checked in storage):
        they begin this attempt's parts, its lines are not run again, and its counters are
        where this attempt's start. False when it holds no result (nothing adopted)."""
        if not checkpoint.lines:
            return False
        with self.lock:
            self.saved = checkpoint
            self.adopted = set(checkpoint.lines)
            self.answered = set(checkpoint.lines)
            self.progress = Progress(**checkpoint.progress.as_fields())
            self.flag_counts = dict(checkpoint.flag_counts)
            self.json_retries = self.adopted_json_retries = checkpoint.json_retries
            self.usage = checkpoint.usage.copy()
        return True
