"""Stored files, the File rows: their content checked and stored, joined, deleted (the
bytes themselves move through jobs.storage, line by line).

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
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

from django.conf import settings
from django.core.files.storage import default_storage
from django.db import transaction
from django.utils import timezone

from jobs.formats.wire import loads_strict
from jobs.lib.errors import ServiceError, not_found, storable_id, wrong_state
from jobs.models import Batch, File
from jobs.services.quotas import check_quota
from jobs.storage.backends import CHUNK, Source, backend
from jobs.storage.lines import Concatenated, Lines, iter_lines
from jobs.storage.objects import new_storage_name, open_range, save_local


def limits() -> dict[str, int]:
    return settings.BATCHWEB


@dataclass
class ScanResult:
    bytes: int
    lines: int
    sha256: str


# A refused file's message names at most this many of its bad lines (with how many there
# are in all): the user fixes them all before uploading again, not one per upload.
MAX_LINES_NAMED = 20


def scan_jsonl(stream: Lines) -> ScanResult:
    """Check that a stream is UTF-8 JSONL with one JSON object per non-blank line, in one
    pass, hashing it on the way. Raises ServiceError (400) naming every bad line, the first
    MAX_LINES_NAMED of them, once the whole stream is read."""
    digest = hashlib.sha256()
    total = 0
    requests = 0
    max_line = limits()["MAX_LINE_BYTES"]
    problems: list[tuple[str, str]] = []  # (code, sentence) of the first bad lines
    bad = 0
    for line in iter_lines(_hashing(stream, digest), max_line_bytes=max_line):
        total = line.end
        if line.content is not None and not line.content.strip():
            continue
        problem = _line_problem(line.content, line.number, max_line)
        if problem is None:
            requests += 1
        else:
            bad += 1
            if len(problems) < MAX_LINES_NAMED:
                problems.append(problem)
    if bad:
        raise _bad_lines(problems, bad)
    if requests == 0:
        raise ServiceError("The file has no requests: a batch file needs one JSON object "
                           "per line.", code="invalid_file", param="file")
    return ScanResult(bytes=total, lines=requests, sha256=digest.hexdigest())


def _line_problem(content: bytes | None, number: int, max_line: int
                  ) -> tuple[str, str] | None:
    """(code, sentence) of a bad line; None for a JSON object."""
    if content is None:
        return "line_too_long", f"Line {number} is longer than {max_line} bytes."
    try:
        obj = loads_strict(content.decode("utf-8"))
    except UnicodeDecodeError:
        return "invalid_file", f"Line {number} is not UTF-8 text."
    except (ValueError, RecursionError):
        return "invalid_file", f"Line {number} is not valid JSON."
    if not isinstance(obj, dict):
        return "invalid_file", f"Line {number} is not a JSON object."
    return None


def _bad_lines(problems: list[tuple[str, str]], bad: int) -> ServiceError:
    """The refusal of a file with `bad` bad lines, `problems` the first of them."""
    codes = {code for code, _ in problems}
    sentences = " ".join(sentence for _, sentence in problems)
    if bad == 1:
        message = sentences
    else:
        named = f"the first {len(problems)}" if bad > len(problems) else "each"
        message = (f"{bad} lines are not one JSON object each ({named} named here); fix "
                   f"them and upload the file again. {sentences}")
    return ServiceError(message, code=codes.pop() if len(codes) == 1 else "invalid_file",
                        param="file")


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
                      expires_after: Any = None, limits_checked: bool = False) -> File:
    """Check an uploaded batch input file (UTF-8 JSONL, size limits) and store it.

    `path` is a local temporary file the caller owns. Nothing is stored when it is refused.
    `limits_checked`: the caller held what it wrote to its own API's limits (a Message
    Batch's body, jobs.services.message_batches), so the service's file size and request
    limits are not applied again; the user's quotas are.
    """
    expires_at = _admit_input(owner=owner, purpose=purpose, expires_after=expires_after,
                              size=os.path.getsize(path), check_size=not limits_checked)
    with open(path, "rb") as handle:
        scan = scan_jsonl(handle)
    if not limits_checked:
        _check_requests(scan)
    return store_file(owner=owner, source_path=path, filename=filename, purpose=purpose,
                      expires_at=expires_at, scan=scan)


def create_input_file_from_parts(*, owner: Any, part_names: list[str], size: int,
                                 filename: str, purpose: Any, md5: str | None = None,
                                 from_upload: str | None = None,
                                 expires_after: Any = None) -> File:
    """The Uploads API's assembly: the stored parts (`size` bytes in all) are read once, in
    order, streamed (md5, the UTF-8 JSONL check, the hash), then joined inside the storage
    into the new file (on S3 by UploadPartCopy): never downloaded to a local copy.

    Refusals come in the order a local assembly gave them: md5, then the file's limits and
    quota, then its content."""
    digest = hashlib.md5(usedforsecurity=False)
    scan: ScanResult | None = None
    refusal: ServiceError | None = None
    with Concatenated(part_names) as stream:
        hashed = _hashing(stream, digest)
        try:
            scan = scan_jsonl(hashed)  # reads every byte, refused or not: the md5 has them
        except ServiceError as exc:
            refusal = exc
    if md5 and digest.hexdigest() != md5.lower():
        raise ServiceError("The md5 of the assembled file does not match.", param="md5")
    expires_at = _admit_input(owner=owner, purpose=purpose, expires_after=expires_after,
                              size=size, from_upload=from_upload)
    if refusal is not None:
        raise refusal
    assert scan is not None
    _check_requests(scan)
    storage_name = new_storage_name("files")
    backend().concatenate(storage_name, part_names)
    return _create_row(owner=owner, storage_name=storage_name, filename=filename,
                       purpose=purpose, expires_at=expires_at, scan=scan)


def _admit_input(*, owner: Any, purpose: Any, expires_after: Any, size: int,
                 from_upload: str | None = None, check_size: bool = True,
                 stored: bool = True) -> Any:
    """Checks on a new input file before its content is read; returns its expiry.
    `stored`: False for a file read in place (registered by reference), which takes no
    room in storage."""
    check_purpose(purpose)
    lifetime = parse_expires_after(expires_after)
    if check_size and size > limits()["MAX_FILE_BYTES"]:
        raise ServiceError(f"File is larger than {limits()['MAX_FILE_BYTES']} bytes.",
                           status=413, code="file_too_large", param="file")
    check_quota(owner=owner, file_bytes=size, from_upload=from_upload, stored=stored)
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
    """Delete a file's row and content. Refused (409) while an active batch reads it. A
    file registered by reference loses its row only: the object is its owner's."""
    with transaction.atomic():
        if file_in_use(file):
            raise wrong_state("The file is the input of a batch that is still running.")
        storage_name = file.storage_name
        file.delete()
        if storage_name:  # empty for a file registered by reference
            transaction.on_commit(lambda: default_storage.delete(storage_name), robust=True)
