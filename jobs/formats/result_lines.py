"""A batch's result lines, wherever they are now, read in order; and the input lines of
the requests asked for by custom_id.

Where results live: once the batch has ended, in its output and error Files; while it runs,
in the parts of its finished shards (`Shard.output_part` / `error_part`) and the checkpoint
segments of its running ones, in shard order. Both are read as a list of segments, and a
cursor names a segment and a byte offset in it ("f:0" for a file, "s3:1024" for shard 3's
part), so a page link stays valid while more shards finish.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any, Literal

from django.conf import settings
from django.core.files.storage import default_storage

from jobs.formats.checkpoint_record import Checkpoint
from jobs.formats.wire import read_result_line
from jobs.lib.heavy import Guard, cached, version
from jobs.models import Batch, File, Shard
from jobs.storage.backends import CHUNK
from jobs.storage.lines import iter_lines
from jobs.storage.objects import open_range

Kind = Literal["output", "error"]

# Finds every `"custom_id": "..."` in a raw line, cheaply; a candidate is confirmed by
# parsing the line, so a nested key of the same name cannot produce a false match.
CUSTOM_ID_RE = re.compile(rb'"custom_id"\s*:\s*"((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Segment:
    key: str
    storage_name: str


def segments(batch: Batch, kind: Kind) -> list[Segment]:
    """Where the batch's `kind` results are now (see the module docstring)."""
    if batch.is_ended:
        file_id = batch.output_file_id if kind == "output" else batch.error_file_id
        file = File.objects.filter(pk=file_id).only("storage_name").first() if file_id else None
        return [Segment("f", file.storage_name)] if file else []
    # A finished shard's part is "s<index>", a running one's checkpoint segments
    # "c<index>.<n>" (a cursor into one is gone once its shard finishes: paging restarts).
    return [Segment(f"s{found.index}" if found.done else f"c{found.index}.{number}", name)
            for found in shard_results(batch, kind, set())
            for number, name in enumerate(found.names)]


@dataclass
class ResultRow:
    """One output or error line, parsed for display."""

    cursor: str
    custom_id: str | None
    status_code: int | None
    code: str | None  # error code: error.code, or http_<status> for HTTP errors
    message: str
    body: Any
    too_long: bool = False
    bytes: int = 0

    @property
    def is_error(self) -> bool:
        return self.code is not None


def parse_result_line(cursor: str, content: bytes | None, size: int) -> ResultRow:
    if content is None:
        return ResultRow(cursor, None, None, "line_too_long", "", None, too_long=True,
                         bytes=size)
    line = read_result_line(content)
    return ResultRow(cursor, line.custom_id, line.status_code, line.code, line.message,
                     line.body, bytes=size)


def scan(segs: list[Segment], start: tuple[str, int] | None, *, max_line_bytes: int
          ) -> Iterator[tuple[str, bytes | None, int]]:
    """(cursor of the line, content, size) for every line from `start` (the spot-check
    sample and the flags pages read their segments the same way)."""
    keys = [s.key for s in segs]
    index, offset = 0, 0
    if start and start[0] in keys:
        index, offset = keys.index(start[0]), start[1]
    # A cursor from before the batch ended names a shard part that no longer exists:
    # start again from the top rather than fail.
    for seg in segs[index:]:
        with open_range(seg.storage_name, offset) as stream:
            for line in iter_lines(stream, max_line_bytes=max_line_bytes, start=offset):
                yield f"{seg.key}:{line.start}", line.content, line.end - line.start
        offset = 0


def failed_custom_ids(batch: Batch, *,
                      which: Callable[[str | None], bool] = lambda code: True) -> set[str]:
    """Every custom_id in the batch's error file whose line's code `which` accepts (whole
    lines are read: an error line is small, and no id may be missed)."""
    ids: set[str] = set()
    for here, content, length in scan(
            segments(batch, "error"), None,
            max_line_bytes=settings.BATCHWEB["MAX_LINE_BYTES"]):
        row = parse_result_line(here, content, length)
        if row.custom_id is not None and which(row.code):
            ids.add(row.custom_id)
    return ids


def iter_input_matches(stream: IO[bytes], wanted: Callable[[str], bool]
                       ) -> Iterator[tuple[str, bytes]]:
    """(custom_id, raw line) of every input line whose custom_id `wanted` accepts."""
    for line in iter_lines(stream, max_line_bytes=settings.BATCHWEB["MAX_LINE_BYTES"]):
        if not line.content:
            continue
        candidates = []
        for match in CUSTOM_ID_RE.finditer(line.content):
            try:
                candidates.append(json.loads(b'"' + match.group(1) + b'"'))
            except ValueError:
                continue
        if not any(wanted(c) for c in candidates):
            continue
        try:
            obj = json.loads(line.content)
        except (ValueError, RecursionError):
            continue
        custom_id = obj.get("custom_id") if isinstance(obj, dict) else None
        if isinstance(custom_id, str) and wanted(custom_id):
            yield custom_id, line.content


def stream_segments(segs: list[Segment]) -> Iterator[bytes]:
    """The segments' bytes, concatenated, in chunks."""
    for seg in segs:
        with open_range(seg.storage_name, 0) as source:
            while chunk := source.read(CHUNK):
                yield chunk


@dataclass
class ShardResults:
    """What a shard of a running batch has answered so far, of one kind, as one stream of
    bytes: its part once it is done, else the segments of its recorded checkpoint (a
    running attempt's, or the one a queued shard's next attempt adopts). The part of a
    finished shard begins with the segments of the checkpoint it adopted, so an offset
    read in the segments stays valid in the part. Only recorded checkpoints are read: a
    fenced-out attempt's segments are never on the row, and never shown."""

    index: int
    done: bool
    names: list[str]

    def read(self, offset: int, *, max_line_bytes: int
             ) -> Iterator[tuple[bytes | None, int, int]]:
        """(content, start, end) of each line from `offset` on, offsets in the stream
        (`content` None: a line longer than `max_line_bytes`)."""
        base = 0
        for name in self.names:
            size = default_storage.size(name) if len(self.names) > 1 else None
            if size is not None and base + size <= offset:
                base += size
                continue
            start = max(offset - base, 0)
            with open_range(name, start) as stream:
                for line in iter_lines(stream, max_line_bytes=max_line_bytes, start=start):
                    yield line.content, base + line.start, base + line.end
            if size is None:
                return
            base += size


def shard_results(batch: Batch, kind: Kind, skip: set[int]) -> list[ShardResults]:
    """The results of `kind` of every shard not in `skip` that has any, in shard order."""
    field_name = "output_part" if kind == "output" else "error_part"
    found = []
    rows = (Shard.objects.filter(batch=batch, status__in=(
        Shard.Status.DONE, Shard.Status.RUNNING, Shard.Status.QUEUED))
        .order_by("index").values_list("index", "status", field_name, "checkpoint"))
    for index, status, part, checkpoint in rows.iterator():
        if index in skip:
            continue
        if status == Shard.Status.DONE:
            names = [part] if part else []
        else:
            names = Checkpoint.from_json(checkpoint).names_of(kind)
        if names or status == Shard.Status.DONE:
            found.append(ShardResults(index, status == Shard.Status.DONE, names))
    return found


def error_counts(batch: Batch, *, guard: Guard | None = None) -> list[tuple[str, int]]:
    """(code, lines) over the whole error file (the finished shards' parts while the batch
    runs), most frequent first. One streaming pass, cached by progress: the key names the
    parts read, so a finished shard counts again and repeated views are a cache read
    (`guard` is entered only to count)."""
    segs = segments(batch, "error")
    return cached(f"errcounts:{batch.pk}:{version(segs)}", lambda: _count_errors(segs),
                  guard=guard)


def _count_errors(segs: list[Segment]) -> list[tuple[str, int]]:
    counts: dict[str, int] = {}
    for here, content, length in scan(
            segs, None, max_line_bytes=settings.BATCHWEB["MAX_LINE_BYTES"]):
        code = parse_result_line(here, content, length).code or "unknown"
        counts[code] = counts.get(code, 0) + 1
    return sorted(counts.items(), key=lambda item: (-item[1], item[0]))
