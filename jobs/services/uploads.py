"""The Uploads API: a big file sent as parts (any order, up to 64 MB each), assembled in the
order the client names on completion, checked like any other batch file.

A pending upload reserves its declared size in the stored-bytes quota (`quotas`), and a
user may have BATCHWEB_MAX_OPEN_UPLOADS pending at once. Parts may arrive in parallel:
each is stored first, then checked against the declared size with the upload's row locked,
so together they never exceed it."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.files.storage import default_storage
from django.db import transaction
from django.db.models import Sum
from django.utils import timezone

from jobs.lib.errors import ServiceError, not_found, storable_id, wrong_state
from jobs.models import Upload, UploadPart
from jobs.services.files import (
    check_purpose,
    clean_filename,
    create_input_file_from_parts,
    delete_file,
    parse_expires_after,
)
from jobs.services.quotas import check_open_uploads, check_quota
from jobs.storage.backends import backend
from jobs.storage.objects import save_local

JSONL_MIME_TYPES = {"application/jsonl", "application/x-ndjson", "application/json",
                    "text/jsonl", "text/plain", "application/octet-stream"}


def create_upload(*, owner: Any, filename: Any, purpose: Any, bytes: Any,
                  mime_type: Any, expires_after: Any = None) -> Upload:
    """A pending upload. `expires_after` (OpenAI's {"anchor": "created_at", "seconds"})
    is the lifetime of the file it completes into, from that file's creation; the upload
    itself, pending, never outlives it either."""
    check_purpose(purpose)
    file_lifetime = parse_expires_after(expires_after)
    if not isinstance(filename, str) or not filename.strip():
        raise ServiceError("filename is required.", param="filename")
    if not isinstance(bytes, int) or isinstance(bytes, bool) or bytes <= 0:
        raise ServiceError("bytes must be a positive integer.", param="bytes")
    limit = min(settings.BATCHWEB["MAX_UPLOAD_BYTES"], settings.BATCHWEB["MAX_FILE_BYTES"])
    if bytes > limit:
        raise ServiceError(f"bytes must be at most {limit}.", status=413,
                           code="file_too_large", param="bytes")
    # Refused before any part is sent, not only when the parts are assembled.
    check_open_uploads(owner=owner)
    check_quota(owner=owner, file_bytes=bytes)
    if mime_type not in JSONL_MIME_TYPES:
        raise ServiceError("mime_type must be a JSONL type such as application/jsonl.",
                           param="mime_type")
    lifetime = timedelta(hours=settings.BATCHWEB["UPLOAD_TTL_HOURS"])
    if file_lifetime is not None:
        lifetime = min(lifetime, file_lifetime)
    return Upload.objects.create(
        owner=owner, filename=clean_filename(filename), purpose=purpose, bytes=bytes,
        mime_type=mime_type, expires_at=timezone.now() + lifetime,
        file_expires_after=(int(file_lifetime.total_seconds()) if file_lifetime is not None
                            else None))


def get_upload_for_user(*, owner: Any, upload_id: str) -> Upload:
    upload = (Upload.objects.filter(owner=owner, pk=upload_id).first()
              if storable_id(upload_id) else None)
    if upload is None:
        raise not_found("upload", upload_id)
    return upload


def _check_pending(upload: Upload) -> None:
    if upload.status == Upload.Status.PENDING and upload.expires_at <= timezone.now():
        Upload.objects.filter(pk=upload.pk, status=Upload.Status.PENDING).update(
            status=Upload.Status.EXPIRED)
        upload.status = Upload.Status.EXPIRED
    if upload.status != Upload.Status.PENDING:
        raise wrong_state(f"The upload is {upload.status}.")


def add_upload_part(*, upload: Upload, path: str | Path) -> UploadPart:
    """Store one part (a local temporary file the caller owns)."""
    _check_pending(upload)
    size = Path(path).stat().st_size
    if size == 0:
        raise ServiceError("A part must not be empty.", param="data")
    if size > settings.BATCHWEB["MAX_UPLOAD_PART_BYTES"]:
        raise ServiceError(f"A part is at most {settings.BATCHWEB['MAX_UPLOAD_PART_BYTES']} bytes.",
                           status=413, code="file_too_large", param="data")
    _check_room(upload, size)  # before storing anything, when it is plainly too much
    storage_name = save_local(path, f"uploads/{upload.pk}")
    try:
        with transaction.atomic():
            # Parts sent in parallel each passed the check above against the same total:
            # with the row locked they are counted one after another (SQLite serializes
            # writers anyway). The storage write stays outside, so parts still upload
            # in parallel.
            locked = Upload.objects.select_for_update().get(pk=upload.pk)
            _check_pending(locked)
            _check_room(locked, size)
            return UploadPart.objects.create(upload=locked, storage_name=storage_name,
                                             bytes=size)
    except Exception:
        default_storage.delete(storage_name)
        raise


def _check_room(upload: Upload, size: int) -> None:
    so_far = upload.parts.aggregate(total=Sum("bytes"))["total"] or 0
    if so_far + size > upload.bytes:
        raise ServiceError(f"The parts would exceed the upload's {upload.bytes} bytes.",
                           param="data")


def complete_upload(*, upload: Upload, part_ids: Any, md5: Any = None) -> Upload:
    """Assemble the parts in the given order into a File; the upload becomes completed."""
    _check_pending(upload)
    if not isinstance(part_ids, list) or not part_ids or \
            not all(isinstance(p, str) for p in part_ids):
        raise ServiceError("part_ids must be a non-empty list of part ids.", param="part_ids")
    if len(set(part_ids)) != len(part_ids):
        raise ServiceError("part_ids lists a part more than once.", param="part_ids")
    parts = {p.pk: p for p in upload.parts.filter(pk__in=part_ids)}
    missing = [p for p in part_ids if p not in parts]
    if missing:
        raise ServiceError(f"Unknown part id for this upload: {missing[0][:64]}",
                           param="part_ids")
    total = sum(parts[p].bytes for p in part_ids)
    if total != upload.bytes:
        raise ServiceError(f"The parts hold {total} bytes; the upload was created for "
                           f"{upload.bytes}.", param="part_ids")
    if md5 not in (None, "") and not isinstance(md5, str):
        raise ServiceError("md5 must be a hex string.", param="md5")
    # Assembled inside the storage (S3: UploadPartCopy), never downloaded to this machine.
    file = create_input_file_from_parts(
        owner=upload.owner, part_names=[parts[p].storage_name for p in part_ids], size=total,
        filename=upload.filename, purpose=upload.purpose, md5=md5 or None,
        from_upload=upload.pk,
        expires_after=({"anchor": "created_at", "seconds": upload.file_expires_after}
                       if upload.file_expires_after else None))
    with transaction.atomic():
        if not Upload.objects.filter(pk=upload.pk, status=Upload.Status.PENDING).update(
                status=Upload.Status.COMPLETED, file=file):
            transaction.on_commit(lambda: delete_file(file=file), robust=True)
            raise wrong_state("The upload was completed or cancelled meanwhile.")
        _delete_parts(upload)
    upload.refresh_from_db()
    return upload


def cancel_upload(*, upload: Upload) -> Upload:
    with transaction.atomic():
        if not Upload.objects.filter(pk=upload.pk, status=Upload.Status.PENDING).update(
                status=Upload.Status.CANCELLED):
            upload.refresh_from_db()
            raise wrong_state(f"The upload is {upload.status}.")
        _delete_parts(upload)
    upload.refresh_from_db()
    return upload


def _delete_parts(upload: Upload) -> None:
    names = list(upload.parts.values_list("storage_name", flat=True))
    upload.parts.all().delete()
    transaction.on_commit(lambda: backend().delete_many(names), robust=True)
