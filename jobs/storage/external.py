"""Objects in buckets the service does not own: the data a user keeps in object storage,
named by `s3://bucket/key`, read in place and written to with the service's credentials
(a grant's credential set, jobs.models.StorageGrant), never the user's.

- `parse_s3_url` is the one rule of what such a name may be;
- `head` tells an object's size, ETag and age;
- `open_reference` reads bytes of a registered object (`ObjectRef`) as the service's own
  objects are read (one Range GET, streamed), but only the version that was registered:
  the GET asks for its ETag (If-Match) and its answer is checked (ETag and whole size), so
  a replaced object raises `ObjectChanged` instead of handing out other data;
- `open_writer` writes an object streamed, as a multipart upload of PART_BYTES at a time;
- `shown_reason` is what a user is told of a failure of any of these (never an address).

Nothing here knows users or grants: jobs.services.grants decides who may name what.
"""

from __future__ import annotations

import io
import re
import threading
from dataclasses import dataclass
from datetime import datetime
from typing import Any, BinaryIO

from django.conf import settings

from jobs.storage.backends import S3Storage, Writer, _Body, _MultipartWriter, backend

SCHEME = "s3://"
# S3's bucket names: 3-63 lower-case letters, digits, dots and hyphens, starting and ending
# with a letter or digit.
BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
MAX_KEY_BYTES = 1024


@dataclass(frozen=True)
class S3Location:
    bucket: str
    key: str  # "" for a whole bucket; a folder prefix ends with "/"

    @property
    def url(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.key}"

    def within(self, prefix: S3Location) -> bool:
        """Whether this name lies under `prefix` (a folder, or a whole bucket). Names are
        compared as written: `parse_s3_url` refused every spelling that could mean
        another place (`..`, `.`, empty segments)."""
        return self.bucket == prefix.bucket and self.key.startswith(prefix.key)


def parse_s3_url(value: object, *, folder: bool) -> S3Location:
    """`s3://bucket/key` (an object, `folder` False) or `s3://bucket/prefix/` (a folder, or
    `s3://bucket/` for a whole bucket: `folder` True). Raises ValueError saying what is
    wrong: another scheme, a malformed bucket, a key with `.` or `..` segments, empty
    segments, a backslash or control characters (all of which some server or client would
    read as another name)."""
    if not isinstance(value, str) or not value.startswith(SCHEME):
        raise ValueError("must be an s3://bucket/key URL")
    bucket, slash, key = value[len(SCHEME):].partition("/")
    if not BUCKET.fullmatch(bucket) or ".." in bucket:
        raise ValueError(f"names no valid bucket ({bucket[:70]!r})")
    if not slash and folder:
        key = ""
    if len(key.encode()) > MAX_KEY_BYTES:
        raise ValueError(f"has a key longer than {MAX_KEY_BYTES} bytes")
    if any(not ch.isprintable() or ch == "\\" for ch in key):
        raise ValueError("has a key with control characters or a backslash")
    segments = key.split("/")
    if folder:
        if key and not key.endswith("/"):
            raise ValueError("must be a folder: end it with '/'")
        segments = segments[:-1]  # the empty one after the last "/"
    elif not key or key.endswith("/"):
        raise ValueError("must name an object, not a bucket or folder")
    if any(segment in ("", ".", "..") for segment in segments):
        raise ValueError("has an empty, '.' or '..' segment in its key")
    return S3Location(bucket, key)


@dataclass(frozen=True)
class ObjectRef:
    """A registered object: where it is, the credential set it is read with, and the
    version that was registered (ETag and size)."""

    bucket: str
    key: str
    etag: str
    size: int
    credentials: str = ""

    @property
    def url(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.key}"


@dataclass(frozen=True)
class ObjectInfo:
    size: int
    etag: str
    modified: datetime


class ObjectChanged(OSError):
    """A registered object is no longer the version that was registered (replaced,
    rewritten or deleted): nothing of it may be read as the registered file."""


class ExternalBucket(S3Storage):
    """A bucket reached with a grant's credential set: names are keys as they are (the
    deployment's key prefix is the service's own bucket's business)."""

    def __init__(self, client: Any, bucket: str) -> None:
        self.storage = None
        self.bucket = bucket
        self._client = client
        self._client_lock = threading.Lock()

    def key(self, name: str) -> str:
        return name

    def name(self, key: str) -> str:
        return key


def own_area() -> S3Location | None:
    """Where the service keeps its own objects, when its storage is S3: its bucket under
    the deployment's key prefix (BATCHWEB_S3_PREFIX), or the whole bucket."""
    storage = backend()
    if not isinstance(storage, S3Storage) or storage.storage is None:
        return None
    folder = str(storage.storage.location or "").strip("/")
    return S3Location(storage.bucket, f"{folder}/" if folder else "")


def inside_own_storage(location: S3Location) -> bool:
    """Whether a name reaches into the service's own objects (every user's files, shard
    parts): never a user's to read or write, whatever a grant says."""
    own = own_area()
    return own is not None and (location.within(own) or own.within(location))


CREDENTIALS_NAME = re.compile(r"[A-Z0-9]+")


def grant_problem(*, prefix: str, credentials: str) -> tuple[str, str] | None:
    """What is wrong with a storage grant's prefix or credential set, as (field, message);
    None when nothing is."""
    try:
        location = parse_s3_url(prefix, folder=True)
    except ValueError as exc:
        return "prefix", f"The prefix {exc}."
    if inside_own_storage(location):
        return "prefix", ("The prefix overlaps the service's own storage (BATCHWEB_S3_BUCKET "
                          "under BATCHWEB_S3_PREFIX), which holds every user's files.")
    if credentials and not CREDENTIALS_NAME.fullmatch(credentials):
        return "credentials", ("A credential set's name is capital letters and digits, as "
                               "in BATCHWEB_DATA_<NAME>_ENDPOINT_URL.")
    if credentials not in settings.DATA_CREDENTIALS:
        return "credentials", (f"No BATCHWEB_DATA_{credentials}_* variables are set here; "
                               "set them for every web and worker process first.")
    return None


_clients: dict[tuple[Any, ...], Any] = {}
_clients_lock = threading.Lock()


def client_for(credentials: str) -> Any:
    """The boto3 client of a credential set (one per set and process: clients are
    thread-safe, and building one costs tens of milliseconds). "" on S3 storage is the
    storage's own connection."""
    storage = backend()
    if not credentials and isinstance(storage, S3Storage):
        return storage.client
    spec = settings.DATA_CREDENTIALS.get(credentials)
    if spec is None:
        raise OSError(f"No credential set {credentials!r}: set BATCHWEB_DATA_{credentials}_"
                      "ENDPOINT_URL and its keys in every process's environment.")
    cache_key = tuple(sorted(spec.items()))
    with _clients_lock:
        if cache_key not in _clients:
            import boto3
            from botocore.config import Config

            _clients[cache_key] = boto3.session.Session().client(
                "s3", endpoint_url=spec["endpoint_url"], region_name=spec["region_name"],
                aws_access_key_id=spec["access_key"],
                aws_secret_access_key=spec["secret_key"],
                config=Config(
                    s3={"addressing_style": "path" if spec["path_style"] else "auto"},
                    signature_version="s3v4", connect_timeout=10, read_timeout=120,
                    retries={"max_attempts": 5, "mode": "standard"}))
        return _clients[cache_key]


def _error_code(exc: Any) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def shown_reason(exc: BaseException) -> str:
    """What a user is told of a failure that may be storage's: the bucket's own refusal (its
    code and message, e.g. "AccessDenied: Access Denied"); only the kind of a failure of the
    connection (botocore's and urllib3's name the endpoint they tried, "Could not connect to
    the endpoint URL: http://<host>:9000/...", an address of the operator's network: the
    caller logs that detail for the operator); any other exception as it is (a changed
    object, a full disk)."""
    from botocore.exceptions import BotoCoreError, ClientError
    from urllib3.exceptions import HTTPError

    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        code = str(error.get("Code", "")) or type(exc).__name__
        message = str(error.get("Message", ""))[:200]
        return f"{code}: {message}" if message else code
    if isinstance(exc, BotoCoreError | HTTPError):
        return f"{type(exc).__name__} (the operator's log has the detail)"
    return f"{type(exc).__name__}: {exc}"


def head(location: S3Location, *, credentials: str) -> ObjectInfo | None:
    """The object's size, ETag and last-modified time; None when there is none. Other
    refusals (access denied, no such bucket) raise botocore's ClientError."""
    from botocore.exceptions import ClientError

    try:
        answer = client_for(credentials).head_object(Bucket=location.bucket,
                                                     Key=location.key)
    except ClientError as exc:
        if _error_code(exc) in ("404", "NoSuchKey", "NotFound"):
            return None
        raise
    return ObjectInfo(size=answer["ContentLength"], etag=answer["ETag"],
                      modified=answer["LastModified"])


def open_reference(ref: ObjectRef, start: int = 0, end: int | None = None) -> BinaryIO:
    """Bytes [start, end) of the registered version of an object (to its end when `end`
    is None), streamed from one Range GET. Raises ObjectChanged when the object there now
    is another version, or none."""
    from botocore.exceptions import ClientError

    if end is not None and end <= start:
        return io.BytesIO(b"")
    byte_range = f"bytes={start}-{'' if end is None else end - 1}"
    try:
        answer = client_for(ref.credentials).get_object(
            Bucket=ref.bucket, Key=ref.key, Range=byte_range, IfMatch=ref.etag)
    except ClientError as exc:
        code = _error_code(exc)
        if code in ("PreconditionFailed", "412"):
            raise ObjectChanged(f"{ref.url} was replaced after it was registered (its "
                                "ETag differs).") from None
        if code in ("NoSuchKey", "404", "NotFound"):
            raise ObjectChanged(f"{ref.url} was deleted after it was registered.") from None
        if code == "InvalidRange":  # start at or past its end: only if it shrank
            raise ObjectChanged(f"{ref.url} is shorter than when it was registered.") from None
        raise
    # Servers that ignore If-Match still say what they sent.
    total = str(answer.get("ContentRange", "")).rpartition("/")[2]
    if answer.get("ETag") != ref.etag or (total.isdigit() and int(total) != ref.size):
        answer["Body"].close()
        raise ObjectChanged(f"{ref.url} changed after it was registered (ETag or size "
                            "differs).")
    return io.BufferedReader(_Body(answer["Body"]), buffer_size=64 * 1024)


def open_writer(location: S3Location, *, credentials: str) -> Writer:
    """A new object at `location`, written streamed (nothing is visible there until the
    writer commits; an aborted writer leaves nothing)."""
    return _MultipartWriter(ExternalBucket(client_for(credentials), location.bucket),
                            location.key)
