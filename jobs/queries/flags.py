"""A batch's quality flags for people: the count of each flag, and the flagged requests
(of one flag, when asked), paged by offset, each with its output line.

Each done shard keeps a small flags part (`Shard.flags_part`): one {"custom_id", "flags"}
line per flagged request, in the shard's order. Flags parts are not merged when the batch
ends, so they are read as shard segments ("s3:120") before and after the end alike.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from django.core.files.storage import default_storage

from jobs.formats.result_lines import (
    ResultRow,
    Segment,
    iter_input_matches,
    parse_result_line,
    scan,
)
from jobs.lib.compiled import Compiled
from jobs.models import Batch, File, Shard
from jobs.policy.quality import FLAG_LABELS, FLAGS
from jobs.queries.results import PAGE_SIZE, PREVIEW_LINE_BYTES, parse_cursor
from jobs.storage.objects import open_range

# Read by the live block of a running batch on every poll of a change: compiled once.
_DONE_COUNTS = Compiled(lambda batch_id: Shard.objects.filter(
    batch_id=batch_id, status=Shard.Status.DONE).values_list("flag_counts"), "batch_id")


def flag_counts(batch: Batch) -> list[tuple[str, str, int]]:
    """(flag, label, requests) of every quality flag, in FLAGS order, summed over the
    batch's finished shards in one query. Every flag is listed, zero or not."""
    totals: dict[str, int] = {}
    for (counts,) in _DONE_COUNTS.rows(batch_id=batch.pk):
        for flag, n in (counts or {}).items():
            if isinstance(n, int):
                totals[flag] = totals.get(flag, 0) + n
    return [(flag, FLAG_LABELS[flag], totals.get(flag, 0)) for flag in FLAGS]


def flag_labels(flags: Iterable[str]) -> list[tuple[str, str]]:
    """(flag, label) of each flag, for display."""
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
        return flag_labels(self.flags)

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
    for here, content, _ in scan(flag_segments(batch) if segs is None else segs, start,
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
    with open_range(storage_name, 0) as stream:
        for custom_id, raw in iter_input_matches(stream, lambda c: c in pending):
            found[custom_id] = parse_result_line(key, raw, len(raw))
            pending.discard(custom_id)
            if not pending:
                break
