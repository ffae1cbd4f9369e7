"""Files registered by reference: a batch input file that is an object of the user's own
bucket, under a prefix granted to them for reading (jobs.services.grants), read in place.

Registering reads the object once, streamed, exactly as an upload is checked (UTF-8 JSONL,
the limits, the line count, the sha256), pinned to the version it found (its ETag, sent
as If-Match). The row records that version; validation, the shards and downloads then read
the object by the same range reads as a stored file (jobs.storage.objects.location), each
refusing any other version (jobs.storage.external.ObjectChanged), so a batch never runs
on data other than what was registered. Nothing is copied into the service's storage, and
deleting the File never deletes the object.
"""

from __future__ import annotations

import logging
from typing import Any

from jobs.lib import heavy
from jobs.lib.errors import ServiceError
from jobs.models import File
from jobs.services.files import (
    _admit_input,
    _check_requests,
    check_purpose,
    clean_filename,
    scan_jsonl,
)
from jobs.services.grants import reach
from jobs.storage.external import ObjectChanged, ObjectRef, head, shown_reason
from jobs.storage.objects import open_range

log = logging.getLogger(__name__)


def register_reference(*, owner: Any, source: Any, purpose: Any,
                       expires_after: Any = None) -> File:
    """A new input File reading the object `source` (s3://bucket/key) in place. Refusals
    are 400s naming `source` (413 for a file over the size limit, as an upload's)."""
    check_purpose(purpose)
    place = reach(owner=owner, url=source, access="read", param="source", folder=False)
    url = place.location.url[:300]
    try:
        info = head(place.location, credentials=place.credentials)
    except Exception as exc:  # refused by the bucket, unreachable, no such credential set
        raise _unreadable(url, exc) from None
    if info is None:
        raise ServiceError(f"source: there is no object {url}.", param="source",
                           code="source_not_found")
    ref = ObjectRef(bucket=place.location.bucket, key=place.location.key, etag=info.etag,
                    size=info.size, credentials=place.credentials)
    try:
        expires_at = _admit_input(owner=owner, purpose=purpose, expires_after=expires_after,
                                  size=info.size, stored=False)
        # A pass over the whole object: one of a user's heavy requests at a time (429).
        with heavy.one_per_user_or_refuse(owner.pk, doing="reading a file"), \
                open_range(ref, 0) as stream:
            scan = _check_requests(scan_jsonl(stream))
    except ServiceError as exc:
        # The upload's own refusals (size, JSONL, limits), about this field.
        if exc.param == "file":
            exc.param = "source"
        raise
    except ObjectChanged as exc:
        raise ServiceError(f"source: {exc} Register it once it is written.", param="source",
                           code="source_changed") from None
    except Exception as exc:
        raise _unreadable(url, exc) from None
    return File.objects.create(
        owner=owner, purpose=purpose, filename=clean_filename(ref.key), bytes=scan.bytes,
        line_count=scan.lines, sha256=scan.sha256, storage_name="", source=ref.url,
        source_etag=info.etag, source_modified=info.modified,
        source_credentials=place.credentials, expires_at=expires_at)


def _unreadable(url: str, exc: Exception) -> ServiceError:
    # The bucket's own refusal (AccessDenied, NoSuchBucket) tells the user what to ask
    # for; anything else (a connection refused names the storage's internal address) only
    # its kind, the detail in the operator's log.
    log.warning("reading %s failed: %s: %s", url, type(exc).__name__, exc)
    return ServiceError(f"source: the service cannot read {url} ({shown_reason(exc)}).",
                        param="source", code="source_unreadable")
