"""Retention: delete what has expired or is no longer referenced, never what an active batch
still needs.

One pass (`run_cleanup`) does, in order:

1. expired files: `File.expires_at` passed; row and content deleted through
   `files.delete_file`, which refuses the input file of an active batch (kept, counted).
   A Message Batch whose results go with them is archived in the same transaction
   (`message_batches.archive_results`: Anthropic's `archived_at`);
2. expired uploads: pending uploads past `expires_at` become `expired`, and the parts of
   every upload that is no longer pending are deleted (rows and content);
3. merged parts: the output and error parts of shards of batches that ended (finalized)
   more than the grace period ago; their content is in the batch's output and error files
   now. Other parts a shard keeps are left alone, and the parts of a batch that has not
   ended are never touched;
4. orphans: objects under `files/`, `uploads/` and `parts/` that no row refers to, older
   than ORPHAN_GRACE_SECONDS (a file is saved a moment before its row exists, and a worker
   saves a part a moment before it records it: young objects are left alone). Objects
   under the prefix of a batch still running or an upload still pending are skipped
   whatever their age. On S3 the same pass lists each prefix in pages (name, size and age
   in one request per thousand objects), deletes in batches, and aborts multipart writes
   begun before the grace period that their killed process never finished (they are
   invisible as objects, but stored and billed);
5. this machine's scratch files (`sweep_temp_dir`): what killed processes left in TMP_DIR.
   TMP_DIR is local to each machine, so every worker also sweeps its own when it starts and
   once per CLEANUP_INTERVAL_SECONDS.

`manage.py cleanup [--dry-run]` runs it; so does the schedule: the reconciler pass that
every worker already runs calls `enqueue_if_due`, which enqueues one
`jobs.tasks.scheduled_cleanup` job on the control queue at most once per
CLEANUP_INTERVAL_SECONDS (a Redis key with that expiry is the lock), so no scheduler
process is needed. (rq 3's `rq.cron` and django-rq's `rqcron` need a `rq cron` process of
their own, and RQ's delayed jobs need a worker started `--with-scheduler`; batchworkers are
neither, so the reconciler is the clock.)
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Q, QuerySet
from django.utils import timezone

from jobs.lib import queues
from jobs.lib.errors import ServiceError
from jobs.models import Batch, File, Shard, Upload, UploadPart
from jobs.services.files import delete_file
from jobs.storage.backends import StoredObject, backend
from jobs.storage.temp import temp_dir

log = logging.getLogger(__name__)

PREFIXES = ("files", "uploads", "parts")
SCHEDULE_KEY = "batchweb:cleanup:scheduled"
CHUNK = 500


@dataclass
class CleanupReport:
    dry_run: bool = False
    expired_files: list[str] = field(default_factory=list)  # File ids
    expired_bytes: int = 0
    archived_batches: int = 0  # Message Batches whose results expired
    kept_in_use: list[str] = field(default_factory=list)  # expired, but an active batch reads it
    expired_uploads: list[str] = field(default_factory=list)
    upload_parts: list[str] = field(default_factory=list)  # storage names
    merged_parts: list[str] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)
    temp_files: list[str] = field(default_factory=list)  # local paths

    def counts(self) -> dict[str, int]:
        return {"expired_files": len(self.expired_files), "expired_bytes": self.expired_bytes,
                "archived_batches": self.archived_batches,
                "kept_in_use": len(self.kept_in_use),
                "expired_uploads": len(self.expired_uploads),
                "upload_parts": len(self.upload_parts), "merged_parts": len(self.merged_parts),
                "orphans": len(self.orphans), "temp_files": len(self.temp_files)}


def grace() -> timedelta:
    return timedelta(seconds=settings.BATCHWEB["ORPHAN_GRACE_SECONDS"])


def run_cleanup(*, dry_run: bool = False, now: datetime | None = None) -> CleanupReport:
    now = now or timezone.now()
    report = CleanupReport(dry_run=dry_run)
    delete_expired_files(files=File.objects.all(), dry_run=dry_run, now=now, report=report)
    _expired_uploads(report, now=now)
    _merged_parts(report, now=now)
    _orphans(report, now=now)
    report.temp_files = sweep_temp_dir(dry_run=dry_run, now=now)
    log.info("cleanup%s: %s", " (dry run)" if dry_run else "", report.counts())
    return report


# --- 1. expired files ---


def delete_expired_files(*, files: QuerySet[File], dry_run: bool = False,
                         now: datetime | None = None,
                         report: CleanupReport | None = None) -> CleanupReport:
    """Delete those of `files` that have expired, except an active batch's input (the admin
    action calls this with the selected rows)."""
    # Imported here: the worker imports this module (its scratch sweep), and the Message
    # Batches service brings validation's imports (numpy among them) that it never needs.
    from jobs.services.message_batches import archive_results

    now = now or timezone.now()
    report = report or CleanupReport(dry_run=dry_run)
    active_inputs = set(Batch.objects.exclude(status__in=Batch.ENDED).values_list(
        "input_file_id", flat=True))
    for file in files.filter(expires_at__lte=now).order_by("expires_at").iterator():
        file_id, size = file.pk, file.bytes  # deleting clears file.pk
        if file_id in active_inputs:
            report.kept_in_use.append(file_id)
            continue
        if not dry_run:
            try:
                # Checks again under a transaction: a batch created meanwhile keeps it
                # (and the archiving of a Message Batch that reads it is undone).
                with transaction.atomic():
                    report.archived_batches += archive_results(file_id=file_id, now=now)
                    delete_file(file=file)
            except ServiceError:
                report.kept_in_use.append(file_id)
                continue
        report.expired_files.append(file_id)
        report.expired_bytes += size
    return report


# --- 2. uploads ---


def _expired_uploads(report: CleanupReport, *, now: datetime) -> None:
    pending_expired = Upload.objects.filter(status=Upload.Status.PENDING, expires_at__lte=now)
    report.expired_uploads = list(pending_expired.values_list("pk", flat=True))
    if not report.dry_run:
        # Conditional: an upload completed in the meantime stays completed.
        Upload.objects.filter(pk__in=report.expired_uploads,
                              status=Upload.Status.PENDING).update(status=Upload.Status.EXPIRED)
        stale = UploadPart.objects.exclude(upload__status=Upload.Status.PENDING)
    else:
        stale = UploadPart.objects.filter(
            Q(upload__pk__in=report.expired_uploads)
            | ~Q(upload__status=Upload.Status.PENDING))
    for part_id, name in stale.values_list("pk", "storage_name").iterator():
        report.upload_parts.append(name)
        if not report.dry_run:
            UploadPart.objects.filter(pk=part_id).delete()
            backend().delete_many([name])


# --- 3. parts of finalized batches ---


def _merged_parts(report: CleanupReport, *, now: datetime) -> None:
    shards = Shard.objects.filter(
        batch__status__in=Batch.ENDED, batch__finalize_claimed_at__lt=now - grace(),
    ).filter(~Q(output_part="") | ~Q(error_part=""))
    for shard_id, output_part, error_part in shards.values_list(
            "pk", "output_part", "error_part").iterator():
        names = [n for n in (output_part, error_part) if n]
        report.merged_parts.extend(names)
        if report.dry_run:
            continue
        # The row first: if deleting the content fails, what is left is an orphan (under
        # an ended batch's prefix) that the orphan sweep removes later.
        Shard.objects.filter(pk=shard_id).update(output_part="", error_part="")
        backend().delete_many(names)


# --- 4. orphans ---


def _chunks(items: Iterable[StoredObject]) -> Iterator[list[StoredObject]]:
    chunk: list[StoredObject] = []
    for item in items:
        chunk.append(item)
        if len(chunk) >= CHUNK:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _shard_part_fields() -> list[str]:
    # Every storage name a shard keeps (output_part, error_part, and any part a later
    # feature adds under the same naming): an object named by any of them is not an orphan.
    return [f.name for f in Shard._meta.get_fields() if f.name.endswith("_part")]


def _referenced(names: list[str]) -> set[str]:
    found = set(File.objects.filter(storage_name__in=names).values_list(
        "storage_name", flat=True))
    found |= set(UploadPart.objects.filter(storage_name__in=names).values_list(
        "storage_name", flat=True))
    for field_name in _shard_part_fields():
        found |= set(Shard.objects.filter(**{f"{field_name}__in": names}).values_list(
            field_name, flat=True))
    return found


def _protected(names: list[str], *, now: datetime) -> set[str]:
    """Names under the folder of a batch that has not ended or an upload still pending."""
    batch_ids = {n.split("/")[1] for n in names if n.startswith("parts/") and n.count("/") >= 2}
    upload_ids = {n.split("/")[1] for n in names
                  if n.startswith("uploads/") and n.count("/") >= 2}
    live = set(Batch.objects.filter(pk__in=batch_ids).exclude(
        status__in=Batch.ENDED).values_list("pk", flat=True))
    live |= set(Upload.objects.filter(pk__in=upload_ids, status=Upload.Status.PENDING,
                                      expires_at__gt=now).values_list("pk", flat=True))
    return {n for n in names if n.count("/") >= 2 and n.split("/")[1] in live}


def _orphans(report: CleanupReport, *, now: datetime) -> None:
    before = now - grace()
    storage = backend()
    for prefix in PREFIXES:
        for objects in _chunks(storage.list_prefix(prefix)):
            names = [o.name for o in objects]
            keep = _referenced(names) | _protected(names, now=now)
            orphans = [o.name for o in objects if o.name not in keep and o.modified < before]
            report.orphans.extend(orphans)
            if not report.dry_run:
                storage.delete_many(orphans)
        report.orphans.extend(storage.abort_incomplete(
            prefix, before=before, keep=lambda names: _protected(names, now=now),
            dry_run=report.dry_run))


# --- the schedule ---


# --- 5. this machine's scratch files ---

def sweep_temp_dir(*, dry_run: bool = False, now: datetime | None = None) -> list[str]:
    """Remove what killed processes left in this machine's TMP_DIR (an upload being
    received, a validation's scratch lists, a storage writer's local copy): a file goes once
    not written to for STALE_TEMP_SECONDS, as its process keeps writing it while alive.
    Returns the paths removed."""
    now = now or timezone.now()
    stale_before = now.timestamp() - settings.BATCHWEB["STALE_TEMP_SECONDS"]
    removed = []
    for path in sorted(temp_dir().iterdir()):
        try:
            if not path.is_file() or path.stat().st_mtime >= stale_before:
                continue
        except FileNotFoundError:  # its process finished with it meanwhile
            continue
        if not dry_run:
            path.unlink(missing_ok=True)
        removed.append(str(path))
    if removed:
        log.info("temp sweep%s: %d files", " (dry run)" if dry_run else "", len(removed))
    return removed


def enqueue_if_due() -> bool:
    """Enqueue one cleanup job if none ran within CLEANUP_INTERVAL_SECONDS. Cheap (one Redis
    SET NX): the reconciler calls it on every pass, in every worker, and only one wins."""
    interval = settings.BATCHWEB["CLEANUP_INTERVAL_SECONDS"]
    if interval <= 0:
        return False
    if not queues.connection().set(SCHEDULE_KEY, timezone.now().isoformat(), nx=True,
                                   ex=interval):
        return False
    queues.queue(queues.CONTROL_QUEUE).enqueue(
        "jobs.tasks.scheduled_cleanup", job_id="batchweb-cleanup",
        job_timeout=settings.BATCHWEB["CONTROL_JOB_TIMEOUT"], result_ttl=24 * 3600,
        failure_ttl=7 * 24 * 3600)
    return True
