"""Stored files: streaming them in and out of Django storage, line by line.

No function here reads a whole file into memory: uploads arrive in a temporary file (Django's
upload handler), are checked in one streaming pass and moved into storage; results are
written to a local temporary file and saved into storage in one step, so a half-written file
is never visible under a File row.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

from django.conf import settings
from django.core.files import File as DjangoFile
from django.core.files.storage import default_storage
from django.db import transaction
from django.utils import timezone

from jobs.models import Batch, File
from jobs.services.errors import ServiceError, not_found, storable_id, wrong_state
from jobs.services.quotas import check_quota
from jobs.wire import loads_strict

CHUNK = 1024 * 1024
UTF8_BOM = b"\xef\xbb\xbf"


def limits() -> dict[str, int]:
    return settings.BATCHWEB


def new_storage_name(prefix: str) -> str:
    # Random, never from the user's filename: nothing the user sends can pick a path.
    return f"{prefix}/{secrets.token_hex(16)}"


def temp_dir() -> Path:
    path = Path(settings.TMP_DIR)
    path.mkdir(parents=True, exist_ok=True)
    return path


@dataclass
class Line:
    number: int  # 1-based, counting every physical line (as editors do)
    start: int  # byte offset of the line in the file
    end: int  # byte offset just past its line ending
    content: bytes | None  # without line ending; None when longer than the limit


def iter_lines(stream: IO[bytes], *, max_line_bytes: int, start: int = 0,
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


def open_file(file: File) -> IO[bytes]:
    return default_storage.open(file.storage_name, "rb")


@contextmanager
def open_range(storage_name: str, start: int) -> Iterator[IO[bytes]]:
    stream = default_storage.open(storage_name, "rb")
    try:
        stream.seek(start)
        yield stream
    finally:
        stream.close()


@contextmanager
def open_range_lines(storage_name: str, *, start: int, end: int,
                     first_number: int) -> Iterator[Iterator[Line]]:
    """The lines of bytes [start, end) of a stored file (a shard's part of its input),
    numbered from `first_number`, streamed."""
    with open_range(storage_name, start) as stream:
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


@dataclass
class ScanResult:
    bytes: int
    lines: int
    sha256: str


def scan_jsonl(stream: IO[bytes]) -> ScanResult:
    """Check that a stream is UTF-8 JSONL with one JSON object per non-blank line, in one
    pass, hashing it on the way. Raises ServiceError (400) naming the first bad line."""
    digest = hashlib.sha256()
    total = 0
    requests = 0
    max_line = limits()["MAX_LINE_BYTES"]
    for line in iter_lines(_hashing(stream, digest), max_line_bytes=max_line):
        total = line.end
        if line.content is None:
            raise ServiceError(f"Line {line.number} is longer than {max_line} bytes.",
                               code="line_too_long", param="file")
        if not line.content.strip():
            continue
        try:
            obj = loads_strict(line.content.decode("utf-8"))
        except UnicodeDecodeError:
            raise ServiceError(f"The file is not UTF-8 text (line {line.number}).",
                               code="invalid_file", param="file") from None
        except (ValueError, RecursionError):
            raise ServiceError(f"Line {line.number} is not valid JSON.", code="invalid_file",
                               param="file") from None
        if not isinstance(obj, dict):
            raise ServiceError(f"Line {line.number} is not a JSON object.",
                               code="invalid_file", param="file")
        requests += 1
    if requests == 0:
        raise ServiceError("The file has no requests: a batch file needs one JSON object "
                           "per line.", code="invalid_file", param="file")
    return ScanResult(bytes=total, lines=requests, sha256=digest.hexdigest())


class _hashing:
    """A read-through wrapper that feeds every byte read into a hash."""

    def __init__(self, stream: IO[bytes], digest: Any) -> None:
        self.stream = stream
        self.digest = digest

    def readline(self, limit: int = -1) -> bytes:
        data = self.stream.readline(limit)
        self.digest.update(data)
        return data


def store_file(*, owner: Any, source_path: str | Path, filename: str, purpose: str,
               expires_at: Any = None, scan: ScanResult | None = None) -> File:
    """Move a finished local file into storage and create its File row.

    The file is saved under a new random name before the row exists, so a crash between the
    two leaves an orphan for cleanup, never a File pointing at missing or partial content.
    When `scan` is not given the file is hashed and its lines counted here.
    """
    source_path = Path(source_path)
    if scan is None:
        scan = _count(source_path)
    with open(source_path, "rb") as handle:
        storage_name = default_storage.save(new_storage_name("files"), DjangoFile(handle))
    try:
        return File.objects.create(
            owner=owner, purpose=purpose, filename=clean_filename(filename), bytes=scan.bytes,
            line_count=scan.lines, sha256=scan.sha256, storage_name=storage_name,
            expires_at=expires_at,
        )
    except BaseException:
        default_storage.delete(storage_name)
        raise


def _count(path: Path) -> ScanResult:
    digest = hashlib.sha256()
    lines = 0
    size = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
            lines += chunk.count(b"\n")
            size += len(chunk)
            last = chunk
        if size and not last.endswith(b"\n"):
            lines += 1
    return ScanResult(bytes=size, lines=lines, sha256=digest.hexdigest())


def clean_filename(name: str) -> str:
    """The name shown and offered on download: the last path component, without control
    characters, at most 255 characters. It never becomes a storage path."""
    name = name.replace("\\", "/").rsplit("/", 1)[-1]
    name = "".join(ch for ch in name if ch.isprintable()).strip()
    if len(name) > 255:
        stem, dot, ext = name.rpartition(".")
        name = (stem[: 250 - len(ext)] + dot + ext) if dot and len(ext) < 10 else name[:255]
    return name or "upload.jsonl"


def parse_expires_after(value: Any) -> timedelta | None:
    """OpenAI's `expires_after`: {"anchor": "created_at", "seconds": 3600..2592000}."""
    if value in (None, ""):
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ServiceError("expires_after must be an object.", param="expires_after") from None
    if not isinstance(value, dict) or value.get("anchor") != "created_at":
        raise ServiceError("expires_after.anchor must be 'created_at'.",
                           param="expires_after.anchor")
    seconds = value.get("seconds")
    try:
        seconds = int(seconds)
    except (TypeError, ValueError):
        raise ServiceError("expires_after.seconds must be an integer.",
                           param="expires_after.seconds") from None
    if not 3600 <= seconds <= 30 * 24 * 3600:
        raise ServiceError("expires_after.seconds must be between 3600 and 2592000.",
                           param="expires_after.seconds")
    return timedelta(seconds=seconds)


def check_purpose(purpose: Any) -> str:
    if purpose != File.Purpose.BATCH:
        raise ServiceError("purpose must be 'batch': this service stores batch input files.",
                           param="purpose")
    return purpose


def create_input_file(*, owner: Any, path: str | Path, filename: str, purpose: Any,
                      expires_after: Any = None) -> File:
    """Check an uploaded batch input file (UTF-8 JSONL, size limits) and store it.

    `path` is a local temporary file the caller owns. Nothing is stored when it is refused.
    """
    check_purpose(purpose)
    lifetime = parse_expires_after(expires_after)
    size = os.path.getsize(path)
    if size > limits()["MAX_FILE_BYTES"]:
        raise ServiceError(f"File is larger than {limits()['MAX_FILE_BYTES']} bytes.",
                           status=413, code="file_too_large", param="file")
    check_quota(owner=owner, file_bytes=size)
    with open(path, "rb") as handle:
        scan = scan_jsonl(handle)
    if scan.lines > limits()["MAX_REQUESTS_PER_BATCH"]:
        raise ServiceError(
            f"File has {scan.lines} requests; a batch takes at most "
            f"{limits()['MAX_REQUESTS_PER_BATCH']}.", code="too_many_requests", param="file")
    now = timezone.now()
    if lifetime is None:
        lifetime = timedelta(days=limits()["INPUT_FILE_TTL_DAYS"])
    return store_file(owner=owner, source_path=path, filename=filename, purpose=purpose,
                      expires_at=now + lifetime, scan=scan)


def get_file_for_user(*, owner: Any, file_id: str) -> File:
    file = File.objects.filter(owner=owner, pk=file_id).first() if storable_id(file_id) else None
    if file is None:
        raise not_found("file", file_id)
    return file


ACTIVE_STATUSES = (Batch.Status.VALIDATING, Batch.Status.IN_PROGRESS,
                   Batch.Status.FINALIZING, Batch.Status.CANCELLING)


def file_in_use(file: File) -> bool:
    return Batch.objects.filter(input_file=file, status__in=ACTIVE_STATUSES).exists()


def delete_file(*, file: File) -> None:
    """Delete a file's row and content. Refused (409) while an active batch reads it."""
    with transaction.atomic():
        if file_in_use(file):
            raise wrong_state("The file is the input of a batch that is still running.")
        storage_name = file.storage_name
        file.delete()
        transaction.on_commit(lambda: default_storage.delete(storage_name), robust=True)


@contextmanager
def local_temp(suffix: str = "") -> Iterator[Path]:
    """A temporary local file path, removed afterwards."""
    fd, name = tempfile.mkstemp(dir=temp_dir(), suffix=suffix)
    os.close(fd)
    try:
        yield Path(name)
    finally:
        Path(name).unlink(missing_ok=True)
