"""Local temporary files: uploads on their way in, files being written before they are
stored, a writer's scratch space on a storage without paths."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from django.conf import settings


def temp_dir() -> Path:
    path = Path(settings.TMP_DIR)
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextmanager
def local_temp(suffix: str = "") -> Iterator[Path]:
    """A temporary local file path, removed afterwards."""
    fd, name = tempfile.mkstemp(dir=temp_dir(), suffix=suffix)
    os.close(fd)
    try:
        yield Path(name)
    finally:
        Path(name).unlink(missing_ok=True)
