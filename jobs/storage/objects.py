"""One stored object by name: a new name for it, a local file saved under it, its bytes
(all, or a range: on S3 a Range GET of exactly those), and where a download of it may be
redirected."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Protocol

from django.conf import settings
from django.core.files.base import ContentFile
from django.core.files.storage import default_storage

from jobs.storage.backends import CHUNK, backend


class Stored(Protocol):
    """What a stored file's row (jobs.models.File) tells of its content."""

    storage_name: str
    filename: str


def new_storage_name(prefix: str) -> str:
    # Random, never from the user's filename: nothing the user sends can pick a path.
    return f"{prefix}/{secrets.token_hex(16)}"


def save_local(path: str | Path, prefix: str) -> str:
    """Store a local file under a new name in `prefix`, streamed through our own writer: on
    S3 at most one part is held in memory (boto3's managed upload holds several at once,
    in threads, for every request doing it)."""
    name = new_storage_name(prefix)
    if Path(path).stat().st_size == 0:  # a writer makes no object of nothing
        return default_storage.save(name, ContentFile(b""))
    with open(path, "rb") as handle, backend().open_writer(name) as writer:
        while chunk := handle.read(CHUNK):
            writer.write(chunk)
    return name


def open_file(file: Stored) -> IO[bytes]:
    """A file's whole content, streamed (on S3 one GET read as it goes, never a local
    copy)."""
    return backend().open_range(file.storage_name)


@contextmanager
def open_range(storage_name: str, start: int, end: int | None = None) -> Iterator[IO[bytes]]:
    """Bytes [start, end) of a stored file (to its end when `end` is None), streamed: on S3
    a Range GET of exactly those bytes."""
    stream = backend().open_range(storage_name, start, end)
    try:
        yield stream
    finally:
        stream.close()


def download_url(file: Stored) -> str | None:
    """Where a download may be redirected instead of streamed through this process: a
    presigned URL valid DOWNLOAD_URL_SECONDS when DOWNLOAD_REDIRECT is on and the storage
    has such URLs (object storage); None otherwise. Only for a file whose owner has been
    checked."""
    if not settings.DOWNLOAD_REDIRECT:
        return None
    return backend().download_url(file.storage_name, filename=file.filename,
                                  seconds=settings.DOWNLOAD_URL_SECONDS)
