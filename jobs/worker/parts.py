"""A claimed shard while its requests are in the engine (`ShardWork`), and its part files:
one local file each for output lines, error lines and quality flags, stored whole when the
shard finishes."""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from django.core.files import File as DjangoFile
from django.core.files.storage import default_storage

from engine.base import EngineResult
from jobs.models import ContentRule, RequestCopy, ScreenedLine, Shard
from jobs.policy import Violation
from jobs.quality import flags_for
from jobs.services.batches import STOP_MESSAGES, shard_last_line
from jobs.services.files import temp_dir
from jobs.services.shards import Progress
from jobs.wire import failure_line, response_line, usage_of

log = logging.getLogger(__name__)

# The kinds of part a shard attempt writes, with their local suffix (jobs.services.cleanup
# recognises these names when it sweeps TMP_DIR).
PART_KINDS = (("output", ".out"), ("error", ".err"), ("flags", ".flags"))


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
    out_path, err_path, flags_path = (base.with_suffix(suffix) for _, suffix in PART_KINDS)
    # Closed by ShardWork.close_files when the shard finishes or is dropped.
    return ShardWork(shard_id=shard.id, attempt=shard.attempt, batch_id=shard.batch_id,
                     out_path=out_path, err_path=err_path,
                     out=open(out_path, "wb"),  # noqa: SIM115
                     err=open(err_path, "wb"),  # noqa: SIM115
                     flags_path=flags_path,
                     flags=open(flags_path, "wb"),  # noqa: SIM115
                     copies=copies, skip=skip, screened=screened)


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
