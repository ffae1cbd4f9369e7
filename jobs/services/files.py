"""Stored files: streaming them in and out of storage (jobs.storage), line by line.

No function here reads a whole file into memory: uploads arrive in a temporary file (Django's
upload handler), are checked in one streaming pass and moved into storage; an assembled
upload or a batch's merged results are joined inside the storage (on S3 by server-side
copies) and become visible under a File row only once complete. Reads of a part of a file
fetch only that part (an HTTP range on S3).
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
from typing import IO, Any, Protocol

from django.conf import settings
from django.core.files.base import ContentFile
from django.core.files.storage import default_storage
from django.db import transaction
from django.utils import timezone

from jobs.models import Batch, File
from jobs.services.errors import ServiceError, not_found, storable_id, wrong_state
from jobs.services.quotas import check_quota
from jobs.storage import Source, backend
from jobs.wire import loads_strict

CHUNK = 1024 * 1024
UTF8_BOM = b"\xef\xbb\xbf"


def limits() -> dict[str, int]:
    return settings.BATCHWEB


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


def temp_dir() -> Path:
    path = Path(settings.TMP_DIR)
    path.mkdir(parents=True, exist_ok=True)
    return path


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


def open_file(file: File) -> IO[bytes]:
    """A file's whole content, streamed (on S3 one GET read as it goes, never a local
    copy)."""
    return backend().open_range(file.storage_name)


def download_url(file: File) -> str | None:
    """Where a download may be redirected instead of streamed through this process: a
    presigned URL valid DOWNLOAD_URL_SECONDS when DOWNLOAD_REDIRECT is on and the storage
    has such URLs (object storage); None otherwise. Only for a file whose owner has been
    checked."""
    if not settings.DOWNLOAD_REDIRECT:
        return None
    return backend().download_url(file.storage_name, filename=file.filename,
                                  seconds=settings.DOWNLOAD_URL_SECONDS)


@contextmanager
def open_range(storage_name: str, start: int, end: int | None = None) -> Iterator[IO[bytes]]:
    """Bytes [start, end) of a stored file (to its end when `end` is None), streamed: on S3
    a Range GET of exactly those bytes."""
    stream = backend().open_range(storage_name, start, end)
    try:
        yield stream
    finally:
        stream.close()


@contextmanager
def open_range_lines(storage_name: str, *, start: int, end: int,
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


class _Concatenated:
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

    def __enter__(self) -> _Concatenated:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.names = []
        self.close()


@dataclass
class ScanResult:
    bytes: int
    lines: int
    sha256: str


def scan_jsonl(stream: Lines) -> ScanResult:
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

    def __init__(self, stream: Lines, digest: Any) -> None:
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
        with open(source_path, "rb") as handle:
            scan = _count(handle)
    storage_name = save_local(source_path, "files")
    return _create_row(owner=owner, storage_name=storage_name, filename=filename,
                       purpose=purpose, expires_at=expires_at, scan=scan)


def store_concatenated(*, owner: Any, sources: list[Source], filename: str, purpose: str,
                       expires_at: Any = None) -> File | None:
    """Join stored objects (and bytes made on the way) into a new File, inside the storage:
    on S3 by server-side copies, with only the pieces under the 5 MiB part minimum streamed
    through this process. None when the sources hold no bytes (no file, as before)."""
    storage_name = new_storage_name("files")
    if not backend().concatenate(storage_name, sources):
        return None
    try:
        # The new object is read once, streamed, for its hash and line count: on S3 the
        # copied bytes never passed through here.
        with open_range(storage_name, 0) as stream:
            scan = _count(stream)
    except BaseException:
        default_storage.delete(storage_name)
        raise
    return _create_row(owner=owner, storage_name=storage_name, filename=filename,
                       purpose=purpose, expires_at=expires_at, scan=scan)


def _create_row(*, owner: Any, storage_name: str, filename: str, purpose: str,
                expires_at: Any, scan: ScanResult) -> File:
    try:
        return File.objects.create(
            owner=owner, purpose=purpose, filename=clean_filename(filename), bytes=scan.bytes,
            line_count=scan.lines, sha256=scan.sha256, storage_name=storage_name,
            expires_at=expires_at,
        )
    except BaseException:
        default_storage.delete(storage_name)
        raise


def _count(stream: IO[bytes]) -> ScanResult:
    digest = hashlib.sha256()
    lines = 0
    size = 0
    last = b""
    while chunk := stream.read(CHUNK):
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
    try:
        seconds = int(value["seconds"])
    except (KeyError, TypeError, ValueError):
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
    expires_at = _admit_input(owner=owner, purpose=purpose, expires_after=expires_after,
                              size=os.path.getsize(path))
    with open(path, "rb") as handle:
        scan = _check_requests(scan_jsonl(handle))
    return store_file(owner=owner, source_path=path, filename=filename, purpose=purpose,
                      expires_at=expires_at, scan=scan)


def create_input_file_from_parts(*, owner: Any, part_names: list[str], size: int,
                                 filename: str, purpose: Any, md5: str | None = None,
                                 from_upload: str | None = None) -> File:
    """The Uploads API's assembly: the stored parts (`size` bytes in all) are read once, in
    order, streamed (md5, the UTF-8 JSONL check, the hash), then joined inside the storage
    into the new file (on S3 by UploadPartCopy): never downloaded to a local copy.

    Refusals come in the order a local assembly gave them: md5, then the file's limits and
    quota, then its content."""
    digest = hashlib.md5(usedforsecurity=False)
    scan: ScanResult | None = None
    refusal: ServiceError | None = None
    with _Concatenated(part_names) as stream:
        hashed = _hashing(stream, digest)
        try:
            scan = scan_jsonl(hashed)
        except ServiceError as exc:
            refusal = exc
            if md5:  # the md5 is of the whole file: read the rest for it
                while hashed.readline(CHUNK):
                    pass
    if md5 and digest.hexdigest() != md5.lower():
        raise ServiceError("The md5 of the assembled file does not match.", param="md5")
    expires_at = _admit_input(owner=owner, purpose=purpose, expires_after=None, size=size,
                              from_upload=from_upload)
    if refusal is not None:
        raise refusal
    assert scan is not None
    _check_requests(scan)
    storage_name = new_storage_name("files")
    backend().concatenate(storage_name, part_names)
    return _create_row(owner=owner, storage_name=storage_name, filename=filename,
                       purpose=purpose, expires_at=expires_at, scan=scan)


def _admit_input(*, owner: Any, purpose: Any, expires_after: Any, size: int,
                 from_upload: str | None = None) -> Any:
    """Checks on a new input file before its content is read; returns its expiry."""
    check_purpose(purpose)
    lifetime = parse_expires_after(expires_after)
    if size > limits()["MAX_FILE_BYTES"]:
        raise ServiceError(f"File is larger than {limits()['MAX_FILE_BYTES']} bytes.",
                           status=413, code="file_too_large", param="file")
    check_quota(owner=owner, file_bytes=size, from_upload=from_upload)
    if lifetime is None:
        lifetime = timedelta(days=limits()["INPUT_FILE_TTL_DAYS"])
    return timezone.now() + lifetime


def _check_requests(scan: ScanResult) -> ScanResult:
    if scan.lines > limits()["MAX_REQUESTS_PER_BATCH"]:
        raise ServiceError(
            f"File has {scan.lines} requests; a batch takes at most "
            f"{limits()['MAX_REQUESTS_PER_BATCH']}.", code="too_many_requests", param="file")
    return scan


def get_file_for_user(*, owner: Any, file_id: str) -> File:
    file = File.objects.filter(owner=owner, pk=file_id).first() if storable_id(file_id) else None
    if file is None:
        raise not_found("file", file_id)
    return file



def file_in_use(file: File) -> bool:
    return Batch.objects.active().filter(input_file=file).exists()


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
