"""What a shard reads of its batch's input: the custom_ids it answers for (its own lines
that are not copies, then the copies of its primaries) and where its lines end."""

from __future__ import annotations

import json
from collections.abc import Iterator

from jobs.models import Batch, RequestCopy, Shard
from jobs.services.files import open_range_lines


def shard_custom_ids(shard: Shard) -> Iterator[str]:
    """The custom_ids a shard answers for: its lines that are not copies, then the copies of
    its primaries."""
    last_line = shard_last_line(shard)
    skip = set(RequestCopy.objects.filter(batch_id=shard.batch_id, line__gte=shard.first_line,
                                          line__lte=last_line).values_list("line", flat=True))
    batch = Batch.objects.only("input_file").get(pk=shard.batch_id)
    with open_range_lines(batch.input_file.storage_name, start=shard.start_byte,
                          end=shard.end_byte, first_number=shard.first_line) as lines:
        for line in lines:
            if line.content is None or not line.content.strip() or line.number in skip:
                continue
            yield json.loads(line.content)["custom_id"]
    yield from RequestCopy.objects.filter(
        batch_id=shard.batch_id, primary_line__gte=shard.first_line,
        primary_line__lte=last_line).values_list("custom_id", flat=True).iterator()


def shard_last_line(shard: Shard) -> int:
    """The number of a shard's last input line (the next shard's first line - 1)."""
    nxt = Shard.objects.filter(batch_id=shard.batch_id, index=shard.index + 1).values_list(
        "first_line", flat=True).first()
    return (nxt - 1) if nxt else 2**31 - 1
