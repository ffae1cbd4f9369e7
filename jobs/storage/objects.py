"""One stored object by name: a new name for it, a local file saved under it, its bytes
(all, or a range: on S3 a Range GET of exactly those), and where a download of it may be
redirected.

A file registered by reference (jobs.storage.external) has no name in the service's
storage: its `Location` is an ObjectRef, which every reader here takes as it takes a name,
so validation, shards and downloads read it by the same ranges."""

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
from jobs.storage.external import ObjectRef, open_reference

# Where bytes to read are: a name in the service's storage, or a registered object of a
# user's bucket.
Location = str | ObjectRef


class Stored(Protocol):
    """What a stored file's row (jobs.models.File) tells of its content."""

    storage_name: str
    filename: str
    bytes: int
    # A file registered by reference: its s3:// URL, the registered version's ETag and
    # the credential set it is read with ("" for the others).
    source: str
    source_etag: str
    source_credentials: str


def location(file: Stored) -> Location:
    """Where a file's bytes are read from."""
    if not file.source:
        return file.storage_name
    bucket, _, key = file.source.removeprefix("s3://").partition("/")
    return ObjectRef(bucket=bucket, key=key, etag=file.source_etag, size=file.bytes,
                     credentials=file.source_credentials)


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
    return _open(location(file), 0, None)


def _open(where: Location, start: int, end: int | None) -> IO[bytes]:
    if isinstance(where, ObjectRef):
        return open_reference(where, start, end)
    return backend().open_range(where, start, end)


@contextmanager
def open_range(storage_name: Location, start: int, end: int | None = None
               ) -> Iterator[IO[bytes]]:
    """Bytes [start, end) of a stored file (to its end when `end` is None), streamed: on S3
    a Range GET of exactly those bytes."""
    stream = _open(storage_name, start, end)
    try:
        yield stream
    finally:
        stream.close()


def download_url(file: Stored) -> str | None:
    """Where a download may be redirected instead of streamed through this process: a
    presigned URL valid DOWNLOAD_URL_SECONDS when DOWNLOAD_REDIRECT is on and the storage
    has such URLs (object storage); None otherwise. Only for a file whose owner has been
    checked."""
    # A registered object is streamed: a presigned URL could not pin its version.
    if not settings.DOWNLOAD_REDIRECT or file.source:
        return None
    return backend().download_url(file.storage_name, filename=file.filename,
                                  seconds=settings.DOWNLOAD_URL_SECONDS)
