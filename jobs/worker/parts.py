"""A claimed shard while its requests are in the engine (`ShardWork`), and its part files:
one local file each for output lines, error lines and quality flags, stored whole when the
shard finishes. A checkpoint stores what was appended to them since the last one as a
segment (jobs.worker.checkpoint); the next attempt of the shard starts its files from the
segments it adopts."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from django.core.files import File as DjangoFile
from django.core.files.base import ContentFile
from django.core.files.storage import default_storage

from engine.base import EngineResult
from jobs.models import ContentRule, ScreenedLine, Shard
from jobs.policy import Violation
from jobs.quality import flags_for
from jobs.services.files import open_range, temp_dir
from jobs.services.shard_input import shard_lines
from jobs.services.shards import Checkpoint, Progress
from jobs.wire import RequestLine, failure_line, response_line, unrun_message, usage_of

log = logging.getLogger(__name__)

# The kinds of part a shard attempt writes, with their local suffix (jobs.services.cleanup
# recognises these names when it sweeps TMP_DIR).
PART_KINDS = (("output", ".out"), ("error", ".err"), ("flags", ".flags"))


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
    pending: dict[str, RequestLine] = field(default_factory=dict)
    progress: Progress = field(default_factory=Progress)
    flag_counts: dict[str, int] = field(default_factory=dict)
    json_retries: int = 0
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
    # The last checkpoint recorded on the row (or the adopted one), the part files' sizes it
    # covers, this attempt's results it holds, and when it was taken.
    saved: Checkpoint = field(default_factory=Checkpoint)
    saved_bytes: tuple[int, int, int] = (0, 0, 0)
    saved_computed: int = 0
    saved_at: float = field(default_factory=time.monotonic)
    # Held while a checkpoint is taken and while the shard finishes: never both at once.
    checkpoint_lock: threading.Lock = field(default_factory=threading.Lock)

    def request_id(self, line: int) -> str:
        return f"{self.shard_id}:{self.attempt}:{line}"

    @contextmanager
    def _writing(self, line: int) -> Iterator[None]:
        # A write that fails (disk full) may leave half a line in the files: the attempt is
        # dead from then on, so no checkpoint takes those bytes before it is dropped.
        try:
            yield
        except OSError:
            self.dead = True
            raise
        self.answered.add(line)

    def unsaved_results(self) -> int:
        """Lines answered since the last checkpoint (with the lock held)."""
        return len(self.answered) - len(self.saved.lines)

    def write_result(self, request: RequestLine, line: int, result: EngineResult) -> None:
        with self._writing(line):
            self._write_result(request, line, result)
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
        if ok:
            tokens_in, tokens_out = usage_of(result.body)
            self.progress.input_tokens += tokens_in
            self.progress.output_tokens += tokens_out

    def write_unrun(self, custom_id: str, line: int, code: str) -> None:
        self.write_failure(custom_id, line, code, unrun_message(code))

    def write_failure(self, custom_id: str, line: int, code: str, message: str) -> None:
        with self._writing(line):
            for cid in [custom_id, *self.copies.get(line, ())]:
                self.err.write(failure_line(cid, code, message))
                self.progress.failed += 1

    def snapshot(self) -> tuple[Checkpoint, tuple[int, int, int], int]:
        """With the lock held: (what a checkpoint taken now holds, without its segments; the
        part files' sizes it covers; this attempt's computed results it holds)."""
        for handle in (self.out, self.err, self.flags):
            handle.flush()
        out_size, err_size, flags_size = (h.tell() for h in (self.out, self.err, self.flags))
        return (Checkpoint(attempt=self.attempt, lines=set(self.answered),
                           progress=Progress(**self.progress.as_fields()),
                           flag_counts=dict(self.flag_counts),
                           json_retries=self.adopted_json_retries + self.retries_answered),
                (out_size, err_size, flags_size), self.computed)

    def paths(self) -> tuple[Path, Path, Path]:
        return self.out_path, self.err_path, self.flags_path

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
        for path in self.paths():
            path.unlink(missing_ok=True)


def open_work(shard: Shard) -> ShardWork:
    """Read what the shard's lines need besides their text (dedup copies, copies to skip,
    screened lines) and open its attempt's part files. Only reads before it opens the
    files: safe to repeat on a dropped connection."""
    lines = shard_lines(shard)
    rules = dict(ScreenedLine.objects.filter(
        batch_id=shard.batch_id, line__gte=shard.first_line, line__lte=lines.last_line
    ).values_list("line", "rule"))
    reasons = dict(ContentRule.objects.values_list("name", "reason")) if rules else {}
    screened = {
        line: Violation(rule=rule, action="skip", reason=reasons.get(rule, "")).message
        for line, rule in rules.items()}
    base = temp_dir() / f"{shard.id}-{shard.attempt}"
    out_path, err_path, flags_path = (base.with_suffix(suffix) for _, suffix in PART_KINDS)
    # Closed by ShardWork.close_files when the shard finishes or is dropped.
    return ShardWork(shard_id=shard.id, attempt=shard.attempt, batch_id=shard.batch_id,
                     out_path=out_path, err_path=err_path,
                     out=open(out_path, "wb"),  # noqa: SIM115
                     err=open(err_path, "wb"),  # noqa: SIM115
                     flags_path=flags_path,
                     flags=open(flags_path, "wb"),  # noqa: SIM115
                     copies=lines.copies, skip=lines.skip, screened=screened)


def adopt_checkpoint(work: ShardWork, value: dict[str, Any]) -> None:
    """Start the attempt from the checkpoint the claim handed on: its segments become the
    beginning of the part files (streamed), its lines are not run again, and its counters
    are where this attempt's start."""
    checkpoint = Checkpoint.from_json(value)
    if not checkpoint.lines:
        return
    for segment in checkpoint.segments:
        for handle, name in zip((work.out, work.err, work.flags), segment, strict=True):
            if name:
                with open_range(name, 0) as source:
                    while chunk := source.read(1024 * 1024):
                        handle.write(chunk)
    with work.lock:
        work.snapshot()  # flushes
        work.saved_bytes = (work.out.tell(), work.err.tell(), work.flags.tell())
        work.saved = checkpoint
        work.adopted = set(checkpoint.lines)
        work.answered = set(checkpoint.lines)
        work.progress = Progress(**checkpoint.progress.as_fields())
        work.flag_counts = dict(checkpoint.flag_counts)
        work.json_retries = work.adopted_json_retries = checkpoint.json_retries
    log.info("shard %s attempt %d adopts %d results of attempt %d", work.shard_id,
             work.attempt, len(checkpoint.lines), checkpoint.attempt)


def store_segment(work: ShardWork, start: tuple[int, int, int],
                  end: tuple[int, int, int]) -> tuple[str, str, str]:
    """Save what the part files got between two sizes (whole lines, flushed) as the next
    checkpoint segment; "" for a kind with nothing new."""
    names = []
    number = len(work.saved.segments)
    for path, (kind, _), first, last in zip(work.paths(), PART_KINDS, start, end, strict=True):
        if last <= first:
            names.append("")
            continue
        with open(path, "rb") as handle:
            handle.seek(first)
            content = handle.read(last - first)
        names.append(default_storage.save(
            f"parts/{work.batch_id}/{work.shard_id}-{work.attempt}.ckpt{number}.{kind}.jsonl",
            ContentFile(content)))
    return names[0], names[1], names[2]


def store_parts(work: ShardWork, stored: list[str]) -> None:
    """Save the attempt's closed part files to storage, appending each storage name ("" for
    an empty part) to `stored` as it goes, so the caller can delete what was saved if a
    later step fails."""
    for path, (kind, _) in zip(work.paths(), PART_KINDS, strict=True):
        if path.stat().st_size == 0:
            stored.append("")
            continue
        with open(path, "rb") as handle:
            stored.append(default_storage.save(
                f"parts/{work.batch_id}/{work.shard_id}-{work.attempt}.{kind}.jsonl",
                DjangoFile(handle)))


def delete_stored(names: list[str]) -> None:
    for name in names:
        if name:
            try:
                default_storage.delete(name)
            except Exception:
                log.exception("could not delete %s", name)
