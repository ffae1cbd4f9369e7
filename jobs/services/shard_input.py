"""What a shard answers for, in one place: the lines of its input range that it runs
(not blank, not a copy of an earlier identical request), the copies its lines answer for
(dedup), and the custom_ids all of that makes. The worker runs a shard from these; the
finalizer writes error lines for an unfinished shard from them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from jobs.models import RequestCopy, Shard
from jobs.services.files import open_range_lines


@dataclass
class ShardLines:
    # The number of the shard's last input line (the next shard's first line - 1).
    last_line: int
    # Lines in the shard's range that are copies, answered by their primary line.
    skip: set[int]
    # Primary line -> the custom_ids of its copies, which get its result too.
    copies: dict[int, list[str]]


def shard_lines(shard: Shard) -> ShardLines:
    nxt = Shard.objects.filter(batch_id=shard.batch_id, index=shard.index + 1).values_list(
        "first_line", flat=True).first()
    last_line = (nxt - 1) if nxt else 2**31 - 1
    if not shard.batch.dedup_saved:
        # Validation records as many copies as it saved: none to read (two reads less for
        # every shard of a batch without duplicates).
        return ShardLines(last_line=last_line, skip=set(), copies={})
    in_range = RequestCopy.objects.filter(batch_id=shard.batch_id)
    skip = set(in_range.filter(line__gte=shard.first_line, line__lte=last_line)
               .values_list("line", flat=True))
    copies: dict[int, list[str]] = {}
    for primary, custom_id in in_range.filter(
            primary_line__gte=shard.first_line, primary_line__lte=last_line
    ).values_list("primary_line", "custom_id").iterator():
        copies.setdefault(primary, []).append(custom_id)
    return ShardLines(last_line=last_line, skip=skip, copies=copies)


@contextmanager
def shard_requests(shard: Shard, skip: set[int]) -> Iterator[Iterator[tuple[int, Any]]]:
    """(line number, request object) of each line the shard runs, streamed from its byte
    range of the input (a Range read on object storage)."""
    storage_name = shard.batch.input_file.storage_name
    with open_range_lines(storage_name, start=shard.start_byte, end=shard.end_byte,
                          first_number=shard.first_line) as lines:
        yield ((line.number, json.loads(line.content)) for line in lines
               if line.content is not None and line.content.strip()
               and line.number not in skip)


def shard_custom_ids(shard: Shard) -> Iterator[str]:
    """The custom_ids a shard answers for: its lines that are not copies, then the copies
    of its primaries."""
    lines = shard_lines(shard)
    with shard_requests(shard, lines.skip) as requests:
        for _, request in requests:
            yield request["custom_id"]
    for custom_ids in lines.copies.values():
        yield from custom_ids
