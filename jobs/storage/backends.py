"""Where files live: one interface over the filesystem (the embedded default, or a shared
NFS directory) and S3-compatible object storage, chosen by STORAGES["default"].

Everything that moves bytes in bulk goes through here, so that on S3

- a shard reads exactly its bytes: an HTTP `Range` GET of [start, end), streamed line by
  line (django-storages' S3File downloads the whole object on its first read);
- output, error and part files are written streamed (multipart upload of PART_BYTES at a
  time), never held whole in memory or on local disk;
- uploads and shard parts are assembled on the server (`UploadPartCopy`), with only the
  pieces under S3's 5 MiB part minimum streamed through this process;
- cleanup lists a prefix in pages of a thousand names with their sizes and ages instead
  of one request per object, and deletes in batches.

Django's `default_storage` stays the way to open, save and delete single small things
(the S3 implementation shares its connection settings and key prefix), so both agree on
every name.

`backend()` returns the implementation for the configured default storage; it follows a
change of settings (tests point it at a local S3 server).
"""

from __future__ import annotations

import io
import os
import secrets
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from django.core.exceptions import ImproperlyConfigured
from django.core.files.storage import Storage, storages

from jobs.storage.temp import temp_dir

CHUNK = 1024 * 1024
# S3 refuses multipart parts under 5 MiB, except the last one.
MIN_PART_BYTES = 5 * 1024 * 1024
# What a streamed writer holds in memory before sending a part: also the most that
# concatenation reads through this process at each junction of small pieces.
PART_BYTES = 8 * 1024 * 1024
# The largest part UploadPartCopy takes.
MAX_COPY_BYTES = 5 * 1024**3

# A concatenation source: a stored object's name, or bytes made on the way (the error
# lines of shards that never ran).
Source = str | Iterable[bytes]


@dataclass(frozen=True)
class StoredObject:
    name: str
    size: int
    modified: datetime


class Writer(Protocol):
    """A new object being written. Nothing is visible under its name until `commit`;
    `abort` (or an exception inside `with`) leaves nothing behind."""

    name: str
    size: int

    def write(self, data: bytes) -> int: ...

    def commit(self) -> str:
        """Publish what was written; returns the name, or "" when nothing was written
        (an empty result is stored as no object at all)."""
        ...

    def abort(self) -> None: ...

    def __enter__(self) -> Writer: ...

    def __exit__(self, *exc: Any) -> None: ...


class ObjectStorage(Protocol):
    def open_range(self, name: str, start: int = 0, end: int | None = None) -> BinaryIO:
        """Bytes [start, end) of an object (to its end when `end` is None), streamed."""
        ...

    def open_writer(self, name: str) -> Writer: ...

    def concatenate(self, target: str, sources: Iterable[Source]) -> int:
        """Store the sources one after the other under `target`; returns its size. Nothing
        is stored when the sources hold no bytes."""
        ...

    def list_prefix(self, prefix: str) -> Iterator[StoredObject]:
        """Every object under the folder `prefix`, at any depth."""
        ...

    def delete_many(self, names: Iterable[str]) -> None: ...

    def abort_incomplete(self, prefix: str, *, before: datetime,
                         keep: Callable[[list[str]], set[str]],
                         dry_run: bool = False) -> list[str]:
        """Writes under `prefix` begun before `before` and never committed or aborted
        (their process was killed), except those whose names `keep` returns: dropped
        unless `dry_run`. Returns their names."""
        ...

    def download_url(self, name: str, *, filename: str, seconds: int) -> str | None:
        """A URL that serves the object as an attachment for `seconds`, without this
        process; None where the storage has none (the filesystem)."""
        ...

    def check(self) -> None:
        """Raise ImproperlyConfigured, naming the setting, if the storage is unusable."""
        ...


# --- the filesystem, or any other Django storage ---


class DjangoStorage:
    """Any Django storage through its own API; the filesystem's paths where it has them
    (writes go to a hidden sibling and are renamed into place on commit)."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage

    def _path(self, name: str) -> Path | None:
        try:
            return Path(self.storage.path(name))
        except NotImplementedError:
            return None

    def open_range(self, name: str, start: int = 0, end: int | None = None) -> BinaryIO:
        stream = self.storage.open(name, "rb")
        stream.seek(start)
        return stream  # type: ignore[return-value]  # callers bound reads by `end`

    def open_writer(self, name: str) -> Writer:
        return _FileWriter(self, name)

    def concatenate(self, target: str, sources: Iterable[Source]) -> int:
        with self.open_writer(target) as writer:
            for source in sources:
                if isinstance(source, str):
                    with self.storage.open(source, "rb") as stream:
                        while chunk := stream.read(CHUNK):
                            writer.write(chunk)
                else:
                    for data in source:
                        writer.write(data)
            size = writer.size
        return size

    def list_prefix(self, prefix: str) -> Iterator[StoredObject]:
        try:
            dirs, names = self.storage.listdir(prefix)
        except (FileNotFoundError, NotADirectoryError):
            return
        for name in names:
            full = f"{prefix}/{name}"
            try:
                size = self.storage.size(full)
                modified = self.storage.get_modified_time(full)
            except FileNotFoundError:  # deleted meanwhile
                continue
            yield StoredObject(full, size, modified)
        for sub in dirs:
            yield from self.list_prefix(f"{prefix}/{sub}")

    def delete_many(self, names: Iterable[str]) -> None:
        for name in names:
            self.storage.delete(name)

    def abort_incomplete(self, prefix: str, *, before: datetime,
                         keep: Callable[[list[str]], set[str]],
                         dry_run: bool = False) -> list[str]:
        # A killed writer's hidden sibling is an unreferenced object under the prefix: the
        # orphan sweep removes it like any other.
        return []

    def download_url(self, name: str, *, filename: str, seconds: int) -> str | None:
        return None

    def check(self) -> None:
        return None


class _FileWriter:
    def __init__(self, owner: DjangoStorage, name: str) -> None:
        self.owner = owner
        self.name = name
        self.size = 0
        path = owner._path(name)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.final: Path | None = path
            self.scratch = path.with_name(f".{path.name}.{secrets.token_hex(4)}.partial")
        else:  # a storage without paths: written locally, saved on commit
            self.final = None
            self.scratch = temp_dir() / f"writer-{secrets.token_hex(8)}"
        self.handle: BinaryIO | None = open(self.scratch, "wb")  # noqa: SIM115

    def write(self, data: bytes) -> int:
        assert self.handle is not None, "written after commit or abort"
        self.handle.write(data)
        self.size += len(data)
        return len(data)

    def commit(self) -> str:
        assert self.handle is not None, "committed twice"
        self.handle.close()
        self.handle = None
        if not self.size:
            self.scratch.unlink(missing_ok=True)
            return ""
        if self.final is not None:
            os.replace(self.scratch, self.final)
            return self.name
        try:
            with open(self.scratch, "rb") as handle:
                from django.core.files import File as DjangoFile

                return self.owner.storage.save(self.name, DjangoFile(handle))
        finally:
            self.scratch.unlink(missing_ok=True)

    def abort(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None
        self.scratch.unlink(missing_ok=True)

    def __enter__(self) -> _FileWriter:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is not None:
            self.abort()
        elif self.handle is not None:
            self.commit()


# --- S3 ---


class S3Storage:
    """S3 through boto3, on the connection, bucket and key prefix of django-storages'
    S3Storage (so `default_storage` and this agree on every name)."""

    def __init__(self, storage: Any) -> None:
        self.storage = storage
        self.bucket = storage.bucket_name
        self._client: Any = None
        self._client_lock = threading.Lock()

    @property
    def client(self) -> Any:
        # One client for every thread: boto3's clients are thread-safe, and building one
        # costs tens of milliseconds of CPU. django-storages builds a resource (and so a
        # client) per thread, and a grouped shard reads its lines from threads of its own:
        # per-thread clients cost a worker ~90 ms a Range GET.
        if self._client is None:
            with self._client_lock:
                if self._client is None:
                    self._client = self.storage.connection.meta.client
        return self._client

    def key(self, name: str) -> str:
        from storages.utils import clean_name

        return self.storage._normalize_name(clean_name(name))

    def name(self, key: str) -> str:
        location = self.storage.location.strip("/")
        return key[len(location) + 1:] if location else key

    def open_range(self, name: str, start: int = 0, end: int | None = None) -> BinaryIO:
        from botocore.exceptions import ClientError

        if end is not None and end <= start:
            return io.BytesIO(b"")
        byte_range = f"bytes={start}-{'' if end is None else end - 1}"
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self.key(name),
                                               Range=byte_range)
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code")
            if code in ("NoSuchKey", "404"):
                raise FileNotFoundError(f"No stored object {name!r}") from None
            if code == "InvalidRange":  # start at or past the end: nothing to read
                return io.BytesIO(b"")
            raise
        return io.BufferedReader(_Body(response["Body"]), buffer_size=64 * 1024)

    def open_writer(self, name: str) -> Writer:
        return _MultipartWriter(self, name)

    def concatenate(self, target: str, sources: Iterable[Source]) -> int:
        with _MultipartWriter(self, target) as writer:
            for source in sources:
                if isinstance(source, str):
                    self._append_object(writer, source)
                else:
                    for data in source:
                        writer.write(data)
            size = writer.size
        return size

    def _append_object(self, writer: _MultipartWriter, name: str) -> None:
        """Copy an object on the server where it forms whole parts; stream through here
        only what must join the buffer (pieces under the part minimum)."""
        key = self.key(name)
        size = self.client.head_object(Bucket=self.bucket, Key=key)["ContentLength"]
        position = 0
        while position < size:
            remaining = size - position
            if not writer.buffered and remaining >= MIN_PART_BYTES:
                length = min(remaining, MAX_COPY_BYTES)
                writer.copy_part(key, position, position + length)
            else:
                # Fill the buffer to a full part (or take the whole small rest).
                length = min(remaining, PART_BYTES - writer.buffered)
                with self.open_range(name, position, position + length) as stream:
                    while chunk := stream.read(CHUNK):
                        writer.write(chunk)
            position += length

    def list_prefix(self, prefix: str) -> Iterator[StoredObject]:
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=self.key(prefix) + "/"):
            for entry in page.get("Contents", ()):
                yield StoredObject(self.name(entry["Key"]), entry["Size"],
                                   entry["LastModified"])

    def delete_many(self, names: Iterable[str]) -> None:
        batch: list[dict[str, str]] = []
        for name in names:
            batch.append({"Key": self.key(name)})
            if len(batch) == 1000:  # DeleteObjects' limit per request
                self._delete(batch)
                batch = []
        if batch:
            self._delete(batch)

    def _delete(self, keys: list[dict[str, str]]) -> None:
        response = self.client.delete_objects(Bucket=self.bucket,
                                              Delete={"Objects": keys, "Quiet": True})
        errors = [e for e in response.get("Errors", ()) if e.get("Code") != "NoSuchKey"]
        if errors:
            raise OSError(f"S3 refused to delete {len(errors)} objects, first "
                          f"{errors[0].get('Key')}: {errors[0].get('Code')} "
                          f"{errors[0].get('Message', '')}")

    def abort_incomplete(self, prefix: str, *, before: datetime,
                         keep: Callable[[list[str]], set[str]],
                         dry_run: bool = False) -> list[str]:
        aborted: list[str] = []
        paginator = self.client.get_paginator("list_multipart_uploads")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=self.key(prefix) + "/"):
            stale = [(self.name(u["Key"]), u) for u in page.get("Uploads", ())
                     if u["Initiated"] < before]
            kept = keep([name for name, _ in stale])
            for name, upload in stale:
                if name in kept:
                    continue
                if not dry_run:
                    self.client.abort_multipart_upload(Bucket=self.bucket, Key=upload["Key"],
                                                       UploadId=upload["UploadId"])
                aborted.append(name)
        return aborted

    def download_url(self, name: str, *, filename: str, seconds: int) -> str | None:
        from django.utils.http import content_disposition_header

        return self.client.generate_presigned_url("get_object", ExpiresIn=seconds, Params={
            "Bucket": self.bucket, "Key": self.key(name),
            "ResponseContentDisposition": content_disposition_header(True, filename),
            "ResponseContentType": "application/jsonl"})

    def check(self) -> None:
        """One listing request with short timeouts and no retries: a wrong endpoint, a
        missing bucket or refused credentials fail the process at start, naming the
        setting, instead of failing the first batch minutes later."""
        import boto3
        from botocore.config import Config
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

        storage = self.storage
        endpoint = storage.endpoint_url or "AWS S3"
        config = storage.client_config.merge(Config(
            connect_timeout=5, read_timeout=10, retries={"max_attempts": 1}))
        client = boto3.Session(
            aws_access_key_id=storage.access_key, aws_secret_access_key=storage.secret_key,
            aws_session_token=storage.security_token,
        ).client("s3", region_name=storage.region_name, endpoint_url=storage.endpoint_url,
                 config=config, verify=storage.verify)
        try:
            client.list_objects_v2(Bucket=self.bucket, Prefix=self.key("files") + "/",
                                   MaxKeys=1)
        except NoCredentialsError:
            raise ImproperlyConfigured(
                "S3 storage has no credentials: set BATCHWEB_S3_ACCESS_KEY_ID and "
                "BATCHWEB_S3_SECRET_ACCESS_KEY (or AWS_ACCESS_KEY_ID / an instance role)."
            ) from None
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            message = exc.response.get("Error", {}).get("Message", "")
            if code == "NoSuchBucket":
                raise ImproperlyConfigured(
                    f"BATCHWEB_S3_BUCKET={self.bucket!r}: no such bucket at {endpoint}."
                ) from None
            if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied",
                        "InvalidToken", "ExpiredToken", "403"):
                raise ImproperlyConfigured(
                    f"BATCHWEB_S3_ACCESS_KEY_ID / BATCHWEB_S3_SECRET_ACCESS_KEY: {endpoint} "
                    f"refused them for bucket {self.bucket!r} ({code}: {message})."
                ) from None
            raise ImproperlyConfigured(
                f"BATCHWEB_S3_BUCKET={self.bucket!r} at {endpoint}: {code}: {message}"
            ) from None
        except (BotoCoreError, ValueError) as exc:
            raise ImproperlyConfigured(
                f"BATCHWEB_S3_ENDPOINT_URL={storage.endpoint_url!r}: cannot reach the S3 "
                f"storage ({type(exc).__name__}: {exc})."
            ) from None


class _Body(io.RawIOBase):
    """A GET's streaming body as a raw stream, so BufferedReader gives it readline."""

    def __init__(self, body: Any) -> None:
        self.body = body

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self.body.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self.body.close()
        super().close()


class _MultipartWriter:
    """A streamed multipart upload: PART_BYTES are held at most, the upload is begun only
    once a full part is ready (a smaller object is one PUT), and aborted on failure."""

    def __init__(self, owner: S3Storage, name: str) -> None:
        self.owner = owner
        self.name = name
        self.key = owner.key(name)
        self.size = 0
        self.buffer = bytearray()
        self.upload_id: str | None = None
        self.parts: list[dict[str, Any]] = []
        self.done = False

    @property
    def buffered(self) -> int:
        return len(self.buffer)

    def _begin(self) -> str:
        if self.upload_id is None:
            self.upload_id = self.owner.client.create_multipart_upload(
                Bucket=self.owner.bucket, Key=self.key,
                ContentType="application/jsonl")["UploadId"]
        return self.upload_id

    def write(self, data: bytes) -> int:
        assert not self.done, "written after commit or abort"
        self.buffer += data
        self.size += len(data)
        while len(self.buffer) >= PART_BYTES:
            self._send(bytes(self.buffer[:PART_BYTES]))
            del self.buffer[:PART_BYTES]
        return len(data)

    def _send(self, data: bytes) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            upload_id = self._begin()
            number = len(self.parts) + 1
            etag = self.owner.client.upload_part(
                Bucket=self.owner.bucket, Key=self.key, UploadId=upload_id,
                PartNumber=number, Body=data)["ETag"]
        except (BotoCoreError, ClientError) as exc:
            # An I/O error like a full disk's, so a writer's caller handles both alike.
            raise OSError(f"storing part {len(self.parts) + 1} of {self.name} failed: "
                          f"{exc}") from exc
        self.parts.append({"PartNumber": number, "ETag": etag})

    def copy_part(self, source_key: str, start: int, end: int) -> None:
        """Append bytes [start, end) of another object, copied on the server. Only valid
        with an empty buffer and at least MIN_PART_BYTES, unless it is the last part."""
        assert not self.buffer
        upload_id = self._begin()
        number = len(self.parts) + 1
        etag = self.owner.client.upload_part_copy(
            Bucket=self.owner.bucket, Key=self.key, UploadId=upload_id, PartNumber=number,
            CopySource={"Bucket": self.owner.bucket, "Key": source_key},
            CopySourceRange=f"bytes={start}-{end - 1}")["CopyPartResult"]["ETag"]
        self.parts.append({"PartNumber": number, "ETag": etag})
        self.size += end - start

    def commit(self) -> str:
        assert not self.done, "committed twice"
        self.done = True
        client, bucket = self.owner.client, self.owner.bucket
        try:
            if not self.size:
                return ""
            if self.upload_id is None:
                client.put_object(Bucket=bucket, Key=self.key, Body=bytes(self.buffer),
                                  ContentType="application/jsonl")
                return self.name
            if self.buffer:
                self._send(bytes(self.buffer))
            client.complete_multipart_upload(Bucket=bucket, Key=self.key,
                                             UploadId=self.upload_id,
                                             MultipartUpload={"Parts": self.parts})
            return self.name
        except BaseException:
            self._abort_upload()
            raise
        finally:
            self.buffer = bytearray()

    def abort(self) -> None:
        if not self.done:
            self.done = True
            self.buffer = bytearray()
            self._abort_upload()

    def _abort_upload(self) -> None:
        if self.upload_id is not None:
            self.owner.client.abort_multipart_upload(
                Bucket=self.owner.bucket, Key=self.key, UploadId=self.upload_id)
            self.upload_id = None

    def __enter__(self) -> _MultipartWriter:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is not None:
            self.abort()
        elif not self.done:
            self.commit()


# --- choosing ---

_chosen: tuple[Any, ObjectStorage] | None = None


def backend() -> ObjectStorage:
    """The implementation for the default storage as settings name it now."""
    global _chosen
    storage = storages["default"]
    if _chosen is None or _chosen[0] is not storage:
        _chosen = (storage, _implementation(storage))
    return _chosen[1]


def _implementation(storage: Storage) -> ObjectStorage:
    # boto3 is imported only where S3 is configured: the filesystem's start stays fast.
    if not type(storage).__module__.startswith("storages.backends.s3"):
        return DjangoStorage(storage)
    from storages.backends.s3 import S3Storage as DjangoS3Storage

    return S3Storage(storage) if isinstance(storage, DjangoS3Storage) else DjangoStorage(storage)


def check_at_start() -> None:
    """The start-up check of the configured storage (jobs.apps): quick and offline for
    the filesystem, one request for S3."""
    backend().check()

