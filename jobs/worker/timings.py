"""How long this worker's control-plane calls take (a shard claim, a heartbeat), as the
worker sees them: what an operator sizing a fleet needs to know (bench/fleet.py reads them).

Off unless BATCHWEB_TIMINGS_DIR is set: then each process appends one line per call,
`<unix time> <kind> <seconds>`, to a file of its own in that directory, written at once (a
few lines a second per worker, so the cost is one small write each)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from django.conf import settings

_lock = threading.Lock()
_out: IO[str] | None = None


@contextmanager
def timed(kind: str) -> Iterator[None]:
    """Record how long the block took under `kind`, when timings are on (also when the
    block raises: a slow failure is a slow call)."""
    directory = settings.BATCHWEB["TIMINGS_DIR"]
    if not directory:
        yield
        return
    start = time.perf_counter()
    try:
        yield
    finally:
        _write(directory, f"{time.time():.3f} {kind} {time.perf_counter() - start:.6f}\n")


def _write(directory: str, line: str) -> None:
    global _out
    with _lock:
        if _out is None:
            Path(directory).mkdir(parents=True, exist_ok=True)
            _out = open(Path(directory) / f"{os.getpid()}.txt", "a",  # noqa: SIM115
                        buffering=1)
        _out.write(line)
