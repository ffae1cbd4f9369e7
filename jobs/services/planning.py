"""Shard planning in file order: a batch's valid lines cut into shards (byte ranges of
SHARD_SIZE requests) while validation reads them, and the duplicate deterministic bodies
among them computed once (dedup). When the lines are worth grouping by prompt prefix,
jobs.services.prefix_plan replaces these shards with grouped ones."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from jobs.formats.prompts import dedup_key
from jobs.formats.wire import RequestLine
from jobs.storage.lines import Line


@dataclass
class ShardPlan:
    index: int
    start_byte: int
    end_byte: int
    first_line: int
    lines: int = 0  # request lines inside the byte range
    # Requests this shard writes results for: its lines, minus copies of primaries held by
    # other shards, plus copies of its own primaries found anywhere.
    responsible: int = 0


# (primary line, copy line, copy custom_id), written out as they are found.
CopySink = Callable[[int, int, str], object]


class ShardPlanner:
    """The shards of the valid lines given to `add`, in file order. Duplicate deterministic
    bodies are reported to `on_copy`; with no sink they are only counted (`dedup_saved`).
    At most `max_bodies` distinct bodies are remembered for dedup, so memory stays small."""

    def __init__(self, *, shard_size: int, max_bodies: int,
                 on_copy: CopySink | None = None) -> None:
        self.shard_size = shard_size
        self.max_bodies = max_bodies
        self.on_copy = on_copy
        self.shards: list[ShardPlan] = []
        self.dedup_saved = 0
        self.primaries: dict[bytes, tuple[int, int]] = {}  # body digest -> (line, shard)
        self.shard: ShardPlan | None = None

    def add(self, line: Line, request: RequestLine) -> int | None:
        """A valid request line: in the current shard, or the first of a new one. Returns
        the line of the primary it is a copy of, None when it runs itself."""
        shard = self.shard
        if shard is None or shard.lines >= self.shard_size:
            shard = self.shard = ShardPlan(index=len(self.shards), start_byte=line.start,
                                           end_byte=line.end, first_line=line.number)
            self.shards.append(shard)
        shard.end_byte = line.end
        shard.lines += 1
        shard.responsible += 1

        key = dedup_key(request)
        if key is None:
            return None
        primary = self.primaries.get(key)
        if primary is None:
            if len(self.primaries) < self.max_bodies:
                self.primaries[key] = (line.number, shard.index)
            return None
        primary_line, primary_shard = primary
        self.dedup_saved += 1
        shard.responsible -= 1
        self.shards[primary_shard].responsible += 1
        if self.on_copy:
            self.on_copy(primary_line, line.number, request.custom_id)
        return primary_line
