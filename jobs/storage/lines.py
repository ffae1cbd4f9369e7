"""Stored bytes read line by line, streamed: a stream's lines with their byte ranges (a
line longer than the limit is reported, never loaded), a range of a stored file's lines,
stored objects read one after the other as one stream."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Any, Protocol

from django.conf import settings

from jobs.storage.backends import CHUNK, backend
from jobs.storage.objects import Location, open_range

UTF8_BOM = b"\xef\xbb\xbf"


class Lines(Protocol):
    """What the line readers need of a stream: a file, a bounded range, parts in a row."""

    def readline(self, limit: int = -1, /) -> bytes: ...


@dataclass
class Line:
    number: int  # 1-based, counting every physical line (as editors do)
    start: int  # byte offset of the line in the file
    end: int  # byte offset just past its line ending
    content: bytes | None  # without line ending; None when longer than the limit


def iter_lines(stream: Lines, *, max_line_bytes: int, start: int = 0,
               first_number: int = 1) -> Iterator[Line]:
    """Every line of a binary stream with its byte range, reading at most
    `max_line_bytes` of any line into memory (a longer line is reported, not loaded)."""
    offset = start
    number = first_number
    while True:
        raw = stream.readline(max_line_bytes + 2)
        if not raw:
            return
        line_start = offset
        offset += len(raw)
        content: bytes | None
        if raw.endswith(b"\n") or len(raw) <= max_line_bytes:
            content = raw.rstrip(b"\r\n")
            if number == 1 and line_start == 0 and content.startswith(UTF8_BOM):
                content = content[len(UTF8_BOM):]
        else:
            # Too long: skip to the end of this line without keeping it.
            content = None
            while not raw.endswith(b"\n"):
                raw = stream.readline(CHUNK)
                if not raw:
                    break
                offset += len(raw)
        yield Line(number=number, start=line_start, end=offset, content=content)
        number += 1


@contextmanager
def open_range_lines(storage_name: Location, *, start: int, end: int,
                     first_number: int) -> Iterator[Iterator[Line]]:
    """The lines of bytes [start, end) of a stored file (a shard's part of its input),
    numbered from `first_number`, streamed."""
    with open_range(storage_name, start, end) as stream:
        yield iter_lines(_Bounded(stream, end - start),
                         max_line_bytes=settings.BATCHWEB["MAX_LINE_BYTES"],
                         start=start, first_number=first_number)


class _Bounded:
    """Read at most `remaining` bytes of a stream through readline."""

    def __init__(self, stream: IO[bytes], remaining: int) -> None:
        self.stream = stream
        self.remaining = remaining

    def readline(self, limit: int = -1) -> bytes:
        if self.remaining <= 0:
            return b""
        limit = self.remaining if limit < 0 else min(limit, self.remaining)
        data = self.stream.readline(limit)
        self.remaining -= len(data)
        return data


class Concatenated:
    """The stored objects `names`, one after the other, as one stream (a line may run on
    from one into the next), each opened only when reached."""

    def __init__(self, names: list[str]) -> None:
        self.names = list(names)
        self.current: IO[bytes] | None = None

    def _next(self) -> bool:
        self.close()
        if not self.names:
            return False
        self.current = backend().open_range(self.names.pop(0))
        return True

    def readline(self, limit: int = -1) -> bytes:
        data = b""
        while not data.endswith(b"\n") and (limit < 0 or len(data) < limit):
            if self.current is None and not self._next():
                break
            assert self.current is not None
            more = self.current.readline(-1 if limit < 0 else limit - len(data))
            if not more:
                self.close()
            data += more
        return data

    def close(self) -> None:
        if self.current is not None:
            self.current.close()
            self.current = None

    def __enter__(self) -> Concatenated:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.names = []
        self.close()
