"""Reading a batch's results for people: pages of output or error lines (paged by byte
offset, never by reading a whole file), error counts by code, the input line behind a
custom_id, the results finished so far while the batch still runs, and the spot-check sample.

Where results live: once the batch has ended, in its output and error Files; while it runs,
in the parts of its finished shards (`Shard.output_part` / `error_part`), in shard order.
Both are read as a list of segments, and a cursor names a segment and a byte offset in it
("f:0" for a file, "s3:1024" for shard 3's part), so a page link stays valid while more
shards finish.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any, Literal

from django.conf import settings
from django.core.cache import cache
from django.core.files.storage import default_storage

from jobs.models import Batch, File, Shard
from jobs.services.errors import ServiceError
from jobs.services.files import CHUNK, iter_lines, open_file, open_range

Kind = Literal["output", "error"]

PAGE_SIZE = 25
# Lines longer than this are listed but not shown (a result line may be megabytes).
PREVIEW_LINE_BYTES = 256 * 1024
# A filtered page stops scanning after this many bytes and offers to continue, so one
# click never reads a whole 200 MB file.
SCAN_BUDGET_BYTES = 32 * 1024 * 1024
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
    field_name = "output_part" if kind == "output" else "error_part"
    parts = (Shard.objects.filter(batch=batch, status=Shard.Status.DONE)
             .exclude(**{field_name: ""}).order_by("index").values_list("index", field_name))
    return [Segment(f"s{index}", name) for index, name in parts]


def parse_cursor(value: str | None) -> tuple[str, int] | None:
    if not value:
        return None
    key, _, offset = value.partition(":")
    if not re.fullmatch(r"f|s\d{1,9}", key) or not offset.isdigit():
        raise ServiceError("Bad page cursor.", param="cursor")
    return key, int(offset)


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
    try:
        obj = json.loads(content)
    except (ValueError, RecursionError):
        return ResultRow(cursor, None, None, "unreadable_line", "", None, bytes=size)
    if not isinstance(obj, dict):
        return ResultRow(cursor, None, None, "unreadable_line", "", None, bytes=size)
    custom_id = obj.get("custom_id") if isinstance(obj.get("custom_id"), str) else None
    error = obj.get("error")
    response = obj.get("response")
    if isinstance(error, dict):
        return ResultRow(cursor, custom_id, None, str(error.get("code") or "error"),
                         str(error.get("message") or ""), None, bytes=size)
    if isinstance(response, dict):
        status = response.get("status_code")
        body = response.get("body")
        if isinstance(status, int) and status >= 400:
            message = ""
            if isinstance(body, dict) and isinstance(body.get("error"), dict):
                message = str(body["error"].get("message") or "")
            return ResultRow(cursor, custom_id, status, f"http_{status}", message, body,
                             bytes=size)
        return ResultRow(cursor, custom_id, status if isinstance(status, int) else None, None,
                         "", body, bytes=size)
    return ResultRow(cursor, custom_id, None, "unreadable_line", "", None, bytes=size)


def _scan(segs: list[Segment], start: tuple[str, int] | None, *, max_line_bytes: int
          ) -> Iterator[tuple[str, bytes | None, int]]:
    """(cursor of the line, content, size) for every line from `start`."""
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
    for here, content, length in _scan(segs, start, max_line_bytes=PREVIEW_LINE_BYTES):
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


def error_counts(batch: Batch) -> list[tuple[str, int]]:
    """(code, lines) over the whole error file, most frequent first. One streaming pass;
    cached for ended batches, whose error file never changes."""
    segs = segments(batch, "error")
    cache_key = f"errcounts:{segs[0].storage_name}" if batch.is_ended and segs else None
    if cache_key and (cached := cache.get(cache_key)) is not None:
        return cached
    counts: dict[str, int] = {}
    for here, content, length in _scan(
            segs, None, max_line_bytes=settings.BATCHWEB["MAX_LINE_BYTES"]):
        code = parse_result_line(here, content, length).code or "unknown"
        counts[code] = counts.get(code, 0) + 1
    result = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    if cache_key:
        cache.set(cache_key, result, 3600)
    return result


def failed_custom_ids(batch: Batch) -> set[str]:
    """Every custom_id in the batch's error file (whole lines are read: an error line is
    small, and no id may be missed)."""
    ids: set[str] = set()
    for here, content, length in _scan(
            segments(batch, "error"), None,
            max_line_bytes=settings.BATCHWEB["MAX_LINE_BYTES"]):
        row = parse_result_line(here, content, length)
        if row.custom_id is not None:
            ids.add(row.custom_id)
    return ids


# --- the input side ---


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


# --- while running ---


def stream_segments(segs: list[Segment]) -> Iterator[bytes]:
    """The segments' bytes, concatenated, in chunks."""
    for seg in segs:
        with default_storage.open(seg.storage_name, "rb") as source:
            while chunk := source.read(CHUNK):
                yield chunk


# --- spot check ---

SPOT_SHARE = 0.05
SPOT_MIN = 10
SPOT_MAX = 200
SPOT_TEXT_CHARS = 4000


def spot_sample_size(finished: int) -> int:
    """5% of the finished requests, at least 10 and at most 200 (never more than exist)."""
    return min(finished, max(SPOT_MIN, min(SPOT_MAX, math.ceil(finished * SPOT_SHARE))))


@dataclass
class SampleItem:
    custom_id: str
    body: Any  # the response body (clipped when huge)
    flags: tuple[str, ...] = ()  # quality flags (the flagged-only sample)

    @property
    def flag_labels(self) -> list[tuple[str, str]]:
        return _labels(self.flags)


def spot_sample(batch: Batch) -> list[SampleItem]:
    """A random sample of the batch's successful results, drawn in one pass (reservoir
    sampling) with the batch id as seed, so the same batch shows the same sample; cached
    for ended batches."""
    segs = segments(batch, "output")
    cache_key = f"spot:{segs[0].storage_name}" if batch.is_ended and segs else None
    if cache_key and (cached := cache.get(cache_key)) is not None:
        return cached
    finished = batch.progress()["completed"]
    k = spot_sample_size(finished)
    if k == 0:
        return []
    rng = random.Random(batch.pk)
    reservoir: list[tuple[str, bytes | None, int]] = []
    for seen, (here, content, length) in enumerate(
            _scan(segs, None, max_line_bytes=PREVIEW_LINE_BYTES), start=1):
        if len(reservoir) < k:
            reservoir.append((here, content, length))
        else:
            j = rng.randrange(seen)
            if j < k:
                reservoir[j] = (here, content, length)
    items = []
    for here, content, length in sorted(reservoir):
        row = parse_result_line(here, content, length)
        if row.custom_id is not None:
            items.append(SampleItem(row.custom_id, row.body))
    if cache_key:
        cache.set(cache_key, items, 3600)
    return items


# --- quality flags ---
#
# Each done shard keeps a small flags part (`Shard.flags_part`): one {"custom_id", "flags"}
# line per flagged request, in the shard's order. Flags parts are not merged when the batch
# ends, so they are read as shard segments ("s3:120") before and after the end alike.


def _labels(flags: Any) -> list[tuple[str, str]]:
    from jobs.quality import FLAG_LABELS

    return [(flag, FLAG_LABELS.get(flag, flag)) for flag in flags]


def flag_segments(batch: Batch) -> list[Segment]:
    parts = (Shard.objects.filter(batch=batch, status=Shard.Status.DONE)
             .exclude(flags_part="").order_by("index").values_list("index", "flags_part"))
    return [Segment(f"s{index}", name) for index, name in parts]


@dataclass
class FlagRow:
    cursor: str
    custom_id: str
    flags: list[str]

    @property
    def flag_labels(self) -> list[tuple[str, str]]:
        return _labels(self.flags)

    @property
    def shard_index(self) -> int:
        return int(self.cursor.partition(":")[0][1:])


def parse_flag_line(cursor: str, content: bytes | None) -> FlagRow | None:
    if not content:
        return None
    try:
        obj = json.loads(content)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("custom_id"), str):
        return None
    flags = [f for f in obj.get("flags") or () if isinstance(f, str)]
    return FlagRow(cursor, obj["custom_id"], flags)


def iter_flagged(batch: Batch, *, flag: str | None = None, start: tuple[str, int] | None = None,
                 segs: list[Segment] | None = None) -> Iterator[FlagRow]:
    """Every flagged request (with `flag`, when given) from `start`, streamed."""
    for here, content, _ in _scan(flag_segments(batch) if segs is None else segs, start,
                                  max_line_bytes=PREVIEW_LINE_BYTES):
        row = parse_flag_line(here, content)
        if row is not None and (flag is None or flag in row.flags):
            yield row


@dataclass
class FlagPage:
    rows: list[FlagRow]
    next_cursor: str | None


def read_flag_page(batch: Batch, *, flag: str | None = None, cursor: str | None = None,
                   size: int = PAGE_SIZE) -> FlagPage:
    """Up to `size` flagged requests (with `flag`, when given) from `cursor`."""
    start = parse_cursor(cursor)
    rows: list[FlagRow] = []
    for row in iter_flagged(batch, flag=flag, start=start):
        if len(rows) >= size:
            return FlagPage(rows, row.cursor)
        rows.append(row)
    return FlagPage(rows, None)


def find_outputs(batch: Batch, rows: list[FlagRow]) -> dict[str, ResultRow]:
    """The output line of each flagged request of a page. A shard's own output part is
    read while it exists (small; the batch still runs or cleanup has not run yet), the
    batch's output file otherwise, in one pass that stops once all are found."""
    by_shard: dict[int, set[str]] = {}
    for row in rows:
        by_shard.setdefault(row.shard_index, set()).add(row.custom_id)
    if not by_shard:
        return {}
    found: dict[str, ResultRow] = {}
    parts = dict(Shard.objects.filter(batch=batch, index__in=list(by_shard))
                 .exclude(output_part="").values_list("index", "output_part"))
    for index, ids in sorted(by_shard.items()):
        name = parts.get(index)
        if name and default_storage.exists(name):
            _scan_for(name, ids, found, f"s{index}")
    missing = {r.custom_id for r in rows} - set(found)
    if missing and batch.is_ended and batch.output_file_id:
        file = File.objects.filter(pk=batch.output_file_id).only("storage_name").first()
        if file is not None and default_storage.exists(file.storage_name):
            _scan_for(file.storage_name, missing, found, "f")
    return found


def _scan_for(storage_name: str, ids: set[str], found: dict[str, ResultRow],
              key: str) -> None:
    pending = set(ids) - set(found)
    if not pending:
        return
    with default_storage.open(storage_name, "rb") as stream:
        for custom_id, raw in iter_input_matches(stream, lambda c: c in pending):
            found[custom_id] = parse_result_line(key, raw, len(raw))
            pending.discard(custom_id)
            if not pending:
                break


def flagged_sample(batch: Batch) -> list[SampleItem]:
    """The spot-check sample drawn among flagged requests only: same rules as spot_sample
    (5% of them, at least 10, at most 200; reservoir sampling seeded by the batch id;
    cached once the batch ended), over the flags parts, then their output lines."""
    segs = flag_segments(batch)
    cache_key = (f"spotflag:{batch.pk}:{batch.output_file_id}" if batch.is_ended else None)
    if cache_key and (cached := cache.get(cache_key)) is not None:
        return cached
    rng = random.Random(batch.pk)
    reservoir: list[FlagRow] = []
    seen = 0
    for row in iter_flagged(batch, segs=segs):
        seen += 1
        if len(reservoir) < SPOT_MAX:
            reservoir.append(row)
        else:
            j = rng.randrange(seen)
            if j < SPOT_MAX:
                reservoir[j] = row
    k = spot_sample_size(seen)
    # The reservoir holds SPOT_MAX uniformly drawn rows; a uniform subset of it is a
    # uniform sample of k.
    chosen = sorted(rng.sample(reservoir, k) if k < len(reservoir) else reservoir,
                    key=lambda r: (r.shard_index, int(r.cursor.partition(":")[2])))
    outputs = find_outputs(batch, chosen)
    items = [SampleItem(r.custom_id, outputs[r.custom_id].body, tuple(r.flags)) for r in chosen
             if r.custom_id in outputs]
    if cache_key:
        cache.set(cache_key, items, 3600)
    return items
