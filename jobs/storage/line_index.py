"""The line index of a grouped batch: where each line a shard runs sits in the input.

One stored object per batch, of fixed 16-byte records (byte offset, length, line number;
little-endian), in run order: shard after shard, each shard's records together. A shard
row holds its record range [lines_from, lines_to), so a worker reads exactly its own
records (a Range GET on object storage), then its lines.

Its lines are scattered over the input, so they are read in chunks of the run order: each
chunk's lines sorted by offset and read as few ranges as cover them, where merging two
neighbouring ranges reads at most 10% more bytes than the lines hold (the bytes read stay
within 1.1x of the shard's own). A chunk's ranges are read concurrently (on object
storage, GETs in parallel). Memory holds one chunk.

The index lives under the batch's folder in `parts/`; the cleanup's orphan sweep removes
it once the batch has ended (it is needed only until then).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import numpy as np

from jobs.storage.backends import backend
from jobs.storage.lines import UTF8_BOM
from jobs.storage.objects import Location, new_storage_name, open_range

# One record per line a grouped shard runs, in run order.
RECORD = np.dtype([("start", "<u8"), ("length", "<u4"), ("line", "<u4")])

# Lines read per chunk, and the bytes a chunk may hold before it is cut short.
CHUNK_LINES = 256
CHUNK_BYTES = 16 * 1024 * 1024
# Ranges of one chunk read at once (on object storage each is a GET).
READERS = 8
# Extra bytes merging may read, as a share of the lines' own.
MERGE_SLACK = 0.10


def write_line_index(batch_id: str, records: np.ndarray) -> str:
    with backend().open_writer(new_storage_name(f"parts/{batch_id}")) as writer:
        for start in range(0, len(records), 65536):
            writer.write(records[start:start + 65536].tobytes())
        return writer.commit()


@lru_cache(maxsize=32)
def read_records(name: str, lines_from: int, lines_to: int) -> np.ndarray:
    """Records [lines_from, lines_to). A line index never changes once written, so the
    last few read are kept: a worker reads a shard's records to look up its copies and
    screened lines, and again to run it."""
    size = RECORD.itemsize
    data = _read(name, (lines_from * size, lines_to * size))
    return np.frombuffer(data, dtype=RECORD)


def _spans(records: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) byte ranges covering the records' lines: neighbours merged, smallest
    gaps first, while the gaps read stay within MERGE_SLACK of the lines' bytes."""
    by_offset = np.sort(records, order="start")
    starts = by_offset["start"].astype(np.int64)
    ends = starts + by_offset["length"].astype(np.int64)
    gaps = np.maximum(starts[1:] - ends[:-1], 0)
    budget = int(MERGE_SLACK * by_offset["length"].sum())
    merge = np.zeros(len(gaps), dtype=bool)
    if len(gaps):
        order = np.argsort(gaps, kind="stable")
        merge[order[np.cumsum(gaps[order]) <= budget]] = True
    spans: list[tuple[int, int]] = []
    span_start, span_end = int(starts[0]), int(ends[0])
    for i in range(1, len(starts)):
        if merge[i - 1]:
            span_end = max(span_end, int(ends[i]))
        else:
            spans.append((span_start, span_end))
            span_start, span_end = int(starts[i]), int(ends[i])
    spans.append((span_start, span_end))
    return spans


def _chunks(records: np.ndarray) -> Iterator[np.ndarray]:
    start = 0
    while start < len(records):
        end = min(start + CHUNK_LINES, len(records))
        lengths = np.cumsum(records["length"][start:end].astype(np.int64))
        fits = int(np.searchsorted(lengths, CHUNK_BYTES, side="right"))
        end = start + max(1, fits)
        yield records[start:end]
        start = end


def _read(storage_name: Location, span: tuple[int, int]) -> bytes:
    """Exactly bytes [start, end) of a stored object (a local file's stream reads on past
    `end`, a network stream may return less per read)."""
    wanted = span[1] - span[0]
    chunks, got = [], 0
    with open_range(storage_name, span[0], span[1]) as stream:
        while got < wanted:
            chunk = stream.read(wanted - got)
            if not chunk:
                raise ValueError(f"{storage_name} ends before byte {span[1]}")
            chunks.append(chunk)
            got += len(chunk)
    return b"".join(chunks)


def iter_indexed_lines(storage_name: Location, records: np.ndarray
                       ) -> Iterator[tuple[int, bytes]]:
    """(line number, content without line ending) of each record's line, in record order."""
    pool = ThreadPoolExecutor(READERS)
    try:
        for chunk in _chunks(records):
            spans = _spans(chunk)
            data = dict(zip((s[0] for s in spans),
                            pool.map(lambda s: _read(storage_name, s), spans), strict=True))
            span_starts = np.array([s[0] for s in spans], dtype=np.int64)
            for record in chunk:
                start = int(record["start"])
                span = int(span_starts[np.searchsorted(span_starts, start, side="right") - 1])
                offset = start - span
                raw = data[span][offset:offset + int(record["length"])]
                if start == 0 and raw.startswith(UTF8_BOM):
                    raw = raw[len(UTF8_BOM):]
                yield int(record["line"]), raw.rstrip(b"\r\n")
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
