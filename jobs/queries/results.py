"""Reading a batch's results for people: pages of output or error lines (paged by byte
offset, never by reading a whole file), error counts by code, the input line behind a
custom_id, and the API's pages of results, while the batch still runs and after. Where
the results are, and how they are read line by line, is `jobs.formats.result_lines`."""

from __future__ import annotations

import base64
import binascii
import json
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from django.core.files.storage import default_storage

from jobs.formats.result_lines import (
    Kind,
    ResultRow,
    ShardResults,
    iter_input_matches,
    parse_result_line,
    scan,
    segments,
    shard_results,
)
from jobs.formats.wire import read_result_line
from jobs.lib.errors import ServiceError
from jobs.models import Batch, File, Shard
from jobs.storage.lines import iter_lines
from jobs.storage.objects import open_file, open_range

PAGE_SIZE = 25
# Lines longer than this are listed but not shown (a result line may be megabytes).
PREVIEW_LINE_BYTES = 256 * 1024
# A filtered page stops scanning after this many bytes and offers to continue, so one
# click never reads a whole 200 MB file.
SCAN_BUDGET_BYTES = 32 * 1024 * 1024


def parse_cursor(value: str | None) -> tuple[str, int] | None:
    if not value:
        return None
    key, _, offset = value.partition(":")
    if not re.fullmatch(r"f|s\d{1,9}|c\d{1,9}\.\d{1,9}", key) or not offset.isdigit():
        raise ServiceError("Bad page cursor.", param="cursor")
    return key, int(offset)


@dataclass
class Page:
    rows: list[ResultRow]
    next_cursor: str | None  # None: nothing more
    scanned_out: bool = False  # stopped by SCAN_BUDGET_BYTES before the page was full


def read_page(batch: Batch, kind: Kind, *, cursor: str | None = None,
              code: str | None = None, search: str | None = None,
              size: int = PAGE_SIZE) -> Page:
    """Up to `size` lines from `cursor`, optionally only those with error `code` and a
    custom_id containing `search`. Reads forward from the cursor only."""
    segs = segments(batch, kind)
    start = parse_cursor(cursor)
    rows: list[ResultRow] = []
    scanned = 0
    # The custom_id as it may appear inside the raw line (JSON-escaped, with or without
    # \u escapes for non-ASCII).
    needles = ({json.dumps(search, ensure_ascii=False)[1:-1].encode(),
                json.dumps(search)[1:-1].encode()} if search else set())
    for here, content, length in scan(segs, start, max_line_bytes=PREVIEW_LINE_BYTES):
        if len(rows) >= size:
            return Page(rows, here)
        scanned += length
        if scanned > SCAN_BUDGET_BYTES and (code or search):
            return Page(rows, here, scanned_out=True)
        # Cheap byte test first: most lines of a big file are skipped without parsing.
        if needles and (content is None or not any(n in content for n in needles)):
            continue
        row = parse_result_line(here, content, length)
        if code and row.code != code:
            continue
        if search and (row.custom_id is None or search not in row.custom_id):
            continue
        rows.append(row)
    return Page(rows, None)


# --- the input side ---


def find_inputs(batch: Batch, custom_ids: set[str]) -> dict[str, dict[str, Any]]:
    """The input request (parsed line) of each custom_id, in one streaming pass over the
    input file that stops once all are found. Empty when the input file is gone."""
    if not custom_ids:
        return {}
    file = File.objects.filter(pk=batch.input_file_id).first()
    if file is None or not default_storage.exists(file.storage_name):
        return {}
    found: dict[str, dict[str, Any]] = {}
    with open_file(file) as stream:
        for custom_id, raw in iter_input_matches(
                stream, lambda c: c in custom_ids and c not in found):
            found[custom_id] = json.loads(raw)
            if len(found) == len(custom_ids):
                break
    return found


# --- the API's results, while the batch runs and after ---

# A page of `GET /v1/batches/{id}/results` holds at most this much (and at least one line).
API_PAGE_BYTES = 8 * 1024 * 1024
# The API's line kinds by the `status` it filters on.
STATUSES: dict[str, Kind] = {"succeeded": "output", "failed": "error"}


@dataclass
class ResultsCursor:
    """Where an API reader of a batch's results stopped. While the batch runs: the shards
    whose results it read to the end (a shard may finish after a later one, so a position
    in shard order alone would skip it), and how far it read of each of the others, by
    kind, as a byte offset in the shard's results (`ShardResults`). Once the batch has
    ended: a position in its output or error File."""

    ended: bool = False
    consumed: set[int] = field(default_factory=set)
    # Shard index -> kind -> bytes read of that kind.
    read: dict[int, dict[Kind, int]] = field(default_factory=dict)
    kind: Kind = "output"  # ended: the file being read
    offset: int = 0

    def encode(self) -> str:
        if self.ended:
            return f"f~{self.kind}~{self.offset}"
        size = max(self.consumed, default=-1) + 1
        bitmap = bytearray((size + 7) // 8)
        for index in self.consumed:
            bitmap[index // 8] |= 1 << (index % 8)
        packed = base64.urlsafe_b64encode(zlib.compress(bytes(bitmap))).decode().rstrip("=")
        here = ",".join(f"{index}.{kinds.get('output', 0)}.{kinds.get('error', 0)}"
                        for index, kinds in sorted(self.read.items()) if any(kinds.values()))
        return f"r~{packed}~{here}"

    @classmethod
    def decode(cls, value: str, *, shards: int) -> ResultsCursor:
        """The cursor `value`, for a batch of `shards` shards: a cursor naming a shard the
        batch does not have is refused before it is expanded."""
        bad = ServiceError("Bad `after` cursor: pass back the X-Next-After header of the "
                           "previous page.", param="after")
        try:
            phase, first, second = value.split("~")
            if phase == "f" and first in ("output", "error") and second.isdigit():
                return cls(ended=True, kind=first, offset=int(second))  # type: ignore[arg-type]
            if phase != "r" or not re.fullmatch(r"[A-Za-z0-9_-]+", first):
                raise bad
            # One byte more than the batch's shards need, so that the bound is never 0
            # (zlib's "unlimited": a batch with no shards yet, validating, would inflate a
            # bomb whole); a bitmap that reaches it names more shards than the batch has.
            need = (shards + 7) // 8
            inflate = zlib.decompressobj()
            bitmap = inflate.decompress(
                base64.urlsafe_b64decode(first + "=" * (-len(first) % 4)), need + 1)
            if len(bitmap) > need or inflate.unconsumed_tail:
                raise bad
            consumed = {i * 8 + bit for i, byte in enumerate(bitmap) for bit in range(8)
                        if byte >> bit & 1}
            read: dict[int, dict[Kind, int]] = {}
            for item in second.split(",") if second else ():
                index, output, error = (int(n) for n in item.split("."))
                if not 0 <= index < shards or min(output, error) < 0 or len(read) >= shards:
                    raise bad
                read[index] = {"output": output, "error": error}
            if max(consumed, default=-1) >= shards:
                raise bad
            return cls(consumed=consumed, read=read)
        except (ValueError, zlib.error, binascii.Error):
            raise bad from None


@dataclass
class ResultsPage:
    lines: list[bytes]
    after: str  # where the next page starts (valid while the batch runs and after)
    has_more: bool  # more lines are there now (a running batch may have more later)
    ended: bool
    restarted: bool = False  # a running batch's cursor, after it ended: read again from the top


def results_page(batch: Batch, *, statuses: tuple[str, ...], custom_id: str | None,
                 after: str | None, limit: int) -> ResultsPage:
    """Up to `limit` result lines in the output-file format (API_PAGE_BYTES at most, and
    SCAN_BUDGET_BYTES read at most when looking for a custom_id), from where `after` left
    off: those answered so far while the batch runs (finished shards' parts, running
    shards' checkpoints), of its files once it ended."""
    kinds = tuple(STATUSES[s] for s in statuses)
    cursor = (ResultsCursor.decode(after, shards=Shard.objects.filter(batch=batch).count())
              if after else ResultsCursor(ended=batch.is_ended))
    restarted = bool(batch.is_ended and not cursor.ended)
    if restarted:
        cursor = ResultsCursor(ended=True)
    needles = ({json.dumps(custom_id, ensure_ascii=False)[1:-1].encode(),
                json.dumps(custom_id)[1:-1].encode()} if custom_id else set())
    lines: list[bytes] = []
    held = scanned = 0

    def read(source: Iterator[tuple[bytes | None, int, int]], at: int) -> tuple[bool, int]:
        """Read lines from offset `at`: (whether to stop here, the page being full or a
        custom_id search having read its budget; the offset reached)."""
        nonlocal held, scanned
        for content, start, end in source:
            at = end
            scanned += end - start
            # content None: a line over the page size, never answered.
            if content is not None and (not needles or (
                    any(n in content for n in needles)
                    and read_result_line(content).custom_id == custom_id)):
                lines.append(content + b"\n")
                held += len(content) + 1
                if len(lines) >= limit or held >= API_PAGE_BYTES:
                    return True, at
            if custom_id and scanned > SCAN_BUDGET_BYTES:
                return True, at
        return False, at

    if cursor.ended:
        files = {"output": batch.output_file_id, "error": batch.error_file_id}
        order = list(kinds)
        start = order.index(cursor.kind) if cursor.kind in order else 0
        for position, kind in enumerate(order[start:]):
            offset = cursor.offset if position == 0 and kind == cursor.kind else 0
            file = File.objects.filter(pk=files[kind]).first() if files[kind] else None
            stop, reached = read(_file_lines(file.storage_name, offset), offset) if file else (
                False, 0)
            if stop:
                at = ResultsCursor(ended=True, kind=kind, offset=reached)
                return ResultsPage(lines, at.encode(), True, True, restarted)
        last = ResultsCursor(ended=True, kind=order[-1], offset=_file_size(files[order[-1]]))
        return ResultsPage(lines, last.encode(), False, True, restarted)

    here = ResultsCursor(consumed=set(cursor.consumed),
                         read={index: dict(kinds) for index, kinds in cursor.read.items()})
    by_shard: dict[int, dict[Kind, ShardResults]] = {}
    for kind in kinds:
        for results in shard_results(batch, kind, cursor.consumed):
            by_shard.setdefault(results.index, {})[kind] = results
    # The shards the reader is inside first, then the others in shard order.
    for index in sorted(by_shard, key=lambda index: (index not in cursor.read, index)):
        offsets = here.read.setdefault(index, {})
        for kind, results in by_shard[index].items():
            stop, offsets[kind] = read(results.read(offsets.get(kind, 0),
                                                    max_line_bytes=API_PAGE_BYTES),
                                       offsets.get(kind, 0))
            if stop:
                return ResultsPage(lines, here.encode(), True, False)
        if all(results.done for results in by_shard[index].values()) and \
                len(by_shard[index]) == len(kinds):
            here.consumed.add(index)
            here.read.pop(index, None)
    return ResultsPage(lines, here.encode(), False, False)


def _file_lines(name: str, offset: int) -> Iterator[tuple[bytes | None, int, int]]:
    with open_range(name, offset) as stream:
        for line in iter_lines(stream, max_line_bytes=API_PAGE_BYTES, start=offset):
            yield line.content, line.start, line.end


def _file_size(file_id: str | None) -> int:
    if not file_id:
        return 0
    return File.objects.filter(pk=file_id).values_list("bytes", flat=True).first() or 0
