"""What a shard answers for, in one place: the input lines that it runs (not blank, not a
copy of an earlier identical request), the copies its lines answer for (dedup), the lines
validation kept from running with the error line each gets (`screened_lines`), and the
custom_ids all of that makes. The worker opens a shard's work from these (`open_input`)
and streams its requests (`shard_requests`); the finalizer writes error lines for an
unfinished shard from them.

A shard's lines are a byte range of the input in file order, or, for a batch grouped by
prompt prefix, its records of the batch's line index (jobs.storage.line_index)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from django.db.models import Q
from django.utils.crypto import salted_hmac

from jobs.formats.checkpoint_record import Checkpoint
from jobs.formats.prompts import Room, room_for
from jobs.formats.wire import LineError, failure_line, refused_line
from jobs.models import ContentRule, RequestCopy, ScreenedLine, Shard
from jobs.policy import VIOLATION, Violation
from jobs.storage.lines import open_range_lines
from jobs.storage.objects import location

# Line numbers per query of a grouped shard's lines (well under SQLite's variable limit).
IN_CHUNK = 500


@dataclass
class ShardLines:
    # The shard's input lines: [first_line, last_line] in file order, or, when `numbers`
    # is set (a grouped shard), exactly those.
    first_line: int
    last_line: int
    numbers: list[int] | None
    # Lines among them that are copies, answered by their primary line.
    skip: set[int]
    # Primary line -> the custom_ids of its copies, which get its result too.
    copies: dict[int, list[str]]
    # A grouped shard's records of the line index (None: a byte range), read once: its
    # lines are streamed by them (`shard_requests`).
    records: Any = None

    def where(self, field: str) -> list[Q]:
        """Filters (one query each) on a line-number field for the shard's lines."""
        if self.numbers is None:
            return [Q(**{f"{field}__gte": self.first_line, f"{field}__lte": self.last_line})]
        return [Q(**{f"{field}__in": self.numbers[i:i + IN_CHUNK]})
                for i in range(0, len(self.numbers), IN_CHUNK)]


def shard_lines(shard: Shard) -> ShardLines:
    if shard.lines_from is not None:
        records = _records(shard)
        numbers = sorted(int(n) for n in records["line"])
        lines = ShardLines(first_line=numbers[0], last_line=numbers[-1], numbers=numbers,
                           skip=set(), copies={}, records=records)
    else:
        nxt = Shard.objects.filter(batch_id=shard.batch_id, index=shard.index + 1
                                   ).values_list("first_line", flat=True).first()
        lines = ShardLines(first_line=shard.first_line,
                           last_line=(nxt - 1) if nxt else 2**31 - 1, numbers=None,
                           skip=set(), copies={})
    if not shard.batch.dedup_saved:
        # Validation records as many copies as it saved: none to read (two reads less for
        # every shard of a batch without duplicates).
        return lines
    in_batch = RequestCopy.objects.filter(batch_id=shard.batch_id)
    if lines.numbers is None:  # a grouped shard's line list holds no copies
        lines.skip = {line for where in lines.where("line")
                      for line in in_batch.filter(where).values_list("line", flat=True)}
    for where in lines.where("primary_line"):
        for primary, custom_id in in_batch.filter(where).values_list(
                "primary_line", "custom_id").iterator():
            lines.copies.setdefault(primary, []).append(custom_id)
    return lines


@dataclass(frozen=True)
class Screened:
    """Why validation kept a line from running (a ScreenedLine row), and its error line."""

    error: LineError
    # A request problem: the endpoint's 400 answer. Else a `skip` content rule's line.
    refused: bool

    def error_line(self, custom_id: str) -> bytes:
        if self.refused:
            return refused_line(custom_id, code=self.error.code, message=self.error.message,
                                param=self.error.param)
        return failure_line(custom_id, self.error.code, self.error.message)


def screened_lines(shard: Shard, lines: ShardLines) -> dict[int, Screened]:
    """The shard's lines that validation kept from running -> the error line each gets. A
    `skip` rule's line reads the rule's reason as the rule says it now."""
    rows = [row for where in lines.where("line")
            for row in ScreenedLine.objects.filter(where, batch_id=shard.batch_id)
            .values_list("line", "rule", "code", "param", "message")]
    reasons = (dict(ContentRule.objects.values_list("name", "reason"))
               if any(rule for _, rule, *_ in rows) else {})
    screened = {}
    for line, rule, code, param, message in rows:
        if rule:
            message = Violation(rule=rule, action="skip", reason=reasons.get(rule, "")).message
            screened[line] = Screened(LineError(VIOLATION, message), refused=False)
        else:
            screened[line] = Screened(LineError(code, message, param or None), refused=True)
    return screened


@dataclass
class ShardInput:
    """What a claimed shard's attempt needs besides its lines' text, read once at its start."""

    # Primary line -> the custom_ids of its copies (dedup); lines that are such copies.
    copies: dict[int, list[str]]
    skip: set[int]
    # Lines validation kept from running -> the error line they get.
    screened: dict[int, Screened]
    # What the batch's model leaves each request's output: the limit the budget counted.
    room: Room
    # The prefix cache salt of the batch owner's requests (`prefix_cache_salt`).
    cache_salt: str
    # The checkpoint the claim handed on (its segments found in storage).
    checkpoint: Checkpoint
    # A grouped shard's records of the line index (ShardLines.records).
    records: Any = None


def open_input(shard: Shard) -> ShardInput:
    """A claimed shard's input as its attempt runs it. Only reads: safe to repeat on a
    dropped connection."""
    cache_salt = prefix_cache_salt(shard.batch.owner_id)
    lines = shard_lines(shard)
    return ShardInput(copies=lines.copies, skip=lines.skip,
                      screened=screened_lines(shard, lines), room=room_for(shard.batch.model),
                      cache_salt=cache_salt, checkpoint=Checkpoint.from_json(shard.checkpoint),
                      records=lines.records)


def prefix_cache_salt(owner_id: int) -> str:
    """The engine's prefix cache salt (vLLM's cache_salt) for one owner's requests. Prompts
    of different owners never share cache entries, so `cached_tokens` tells no user how
    another's prompts begin; one owner's batches still share theirs. Keyed with the secret
    key: no user can compute another's salt (validation refuses the field anyway)."""
    return salted_hmac("batchweb.prefix-cache-salt", str(owner_id),
                       algorithm="sha256").hexdigest()


def _records(shard: Shard) -> Any:
    # The line index (and numpy with it) is imported by the workers that run a grouped
    # shard only: ~0.1 s of each worker's start otherwise.
    from jobs.storage.line_index import read_records

    assert shard.lines_from is not None and shard.lines_to is not None
    return read_records(shard.batch.line_index, shard.lines_from, shard.lines_to)


@contextmanager
def shard_requests(shard: Shard, *, skip: set[int], records: Any
                   ) -> Iterator[Iterator[tuple[int, Any]]]:
    """(line number, request object) of each line the shard runs, in the order it runs
    them, streamed from the input: its byte range (a Range read on object storage), or the
    lines its `records` in the line index name (ShardLines.records: None for a range)."""
    # A stored name, or a registered object pinned to its version (a replaced one raises
    # ObjectChanged before a line is read).
    storage_name = location(shard.batch.input_file)
    if records is not None:
        from jobs.storage.line_index import iter_indexed_lines

        lines = iter_indexed_lines(storage_name, records)
        yield ((number, json.loads(content)) for number, content in lines
               if number not in skip)
        return
    with open_range_lines(storage_name, start=shard.start_byte, end=shard.end_byte,
                          first_number=shard.first_line) as range_lines:
        yield ((line.number, json.loads(line.content)) for line in range_lines
               if line.content is not None and line.content.strip()
               and line.number not in skip)


def shard_custom_ids(shard: Shard) -> Iterator[str]:
    """The custom_ids a shard answers for: its lines that are not copies, then the copies
    of its primaries."""
    lines = shard_lines(shard)
    with shard_requests(shard, skip=lines.skip, records=lines.records) as requests:
        for _, request in requests:
            yield request["custom_id"]
    for custom_ids in lines.copies.values():
        yield from custom_ids
