"""The lifecycle of a batch (OpenAI's): validating -> failed | in_progress -> finalizing ->
completed; in_progress -> expired; validating/in_progress -> cancelling -> cancelled.

Each transition is one conditional UPDATE on the state it leaves, so two workers (or a
worker and a user pressing cancel) can never both perform it.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from datetime import timedelta
from typing import IO, Any

from django.conf import settings
from django.db import transaction
from django.db.models import OuterRef, Q, Subquery, Sum
from django.db.models.functions import Coalesce
from django.utils import timezone

from engine.base import ENDPOINTS
from jobs import queues
from jobs.models import PROGRESS_FIELDS, Batch, File, RequestCopy, Shard
from jobs.services.errors import ServiceError, not_found, storable_id, wrong_state
from jobs.services.files import (
    get_file_for_user,
    local_temp,
    open_range_lines,
    parse_expires_after,
    store_file,
)
from jobs.services.quotas import check_quota
from jobs.wire import Code, failure_line

log = logging.getLogger(__name__)

WINDOW_PATTERN = re.compile(r"^([1-9][0-9]{0,3})h$")
MAX_METADATA_PAIRS = 16
STOP_MESSAGES = {
    Code.BATCH_CANCELLED: "The batch was cancelled before this request ran.",
    Code.BATCH_EXPIRED: "The batch expired before this request ran.",
}


def parse_completion_window(value: Any) -> timedelta:
    """'24h' as OpenAI; other whole hours within the configured bounds ('1h', '72h')."""
    conf = settings.BATCHWEB
    match = WINDOW_PATTERN.fullmatch(value) if isinstance(value, str) else None
    hours = int(match.group(1)) if match else 0
    if not conf["MIN_WINDOW_HOURS"] <= hours <= conf["MAX_WINDOW_HOURS"]:
        raise ServiceError(
            f"completion_window must be whole hours like '24h', from "
            f"{conf['MIN_WINDOW_HOURS']}h to {conf['MAX_WINDOW_HOURS']}h.",
            param="completion_window")
    return timedelta(hours=hours)


def check_metadata(value: Any) -> dict[str, str]:
    """OpenAI's metadata: at most 16 string pairs, keys <= 64 and values <= 512 chars."""
    if value in (None, ""):
        return {}
    if not isinstance(value, dict):
        raise ServiceError("metadata must be an object of strings.", param="metadata")
    if len(value) > MAX_METADATA_PAIRS:
        raise ServiceError("metadata takes at most 16 pairs.", param="metadata")
    for key, item in value.items():
        if not isinstance(key, str) or not key or len(key) > 64 or "\x00" in key:
            raise ServiceError("metadata keys must be strings of 1 to 64 characters.",
                               param="metadata")
        if not isinstance(item, str) or len(item) > 512 or "\x00" in item:
            raise ServiceError("metadata values must be strings of at most 512 characters.",
                               param=f"metadata.{key}"[:100])
    return value


def check_priority(value: Any) -> str:
    if value in (None, ""):
        return Batch.Priority.DEFAULT
    if value not in Batch.Priority.values:
        raise ServiceError("priority must be one of high, default, low.", param="priority")
    return value


def create_batch(*, owner: Any, input_file_id: Any, endpoint: Any, completion_window: Any,
                 metadata: Any = None, priority: Any = None,
                 output_expires_after: Any = None) -> Batch:
    """Create a batch in `validating` and, after commit, enqueue its validation."""
    if endpoint not in ENDPOINTS:
        raise ServiceError(f"endpoint must be one of {', '.join(ENDPOINTS)}.", param="endpoint")
    window = parse_completion_window(completion_window)
    metadata = check_metadata(metadata)
    priority = check_priority(priority)
    output_lifetime = parse_expires_after(output_expires_after)
    if not isinstance(input_file_id, str) or not input_file_id:
        raise ServiceError("input_file_id is required.", param="input_file_id")
    input_file = get_file_for_user(owner=owner, file_id=input_file_id)
    if input_file.purpose != File.Purpose.BATCH:
        raise ServiceError("The input file must have purpose 'batch'.", param="input_file_id")
    check_quota(owner=owner, batch_requests=input_file.line_count)
    now = timezone.now()
    batch = Batch.objects.create(
        owner=owner, endpoint=endpoint, input_file=input_file,
        completion_window=completion_window, metadata=metadata, priority=priority,
        output_expires_after=int(output_lifetime.total_seconds()) if output_lifetime else None,
        expires_at=now + window,
    )
    batch_id = batch.id
    # robust: if Redis is down the batch is still created; the reconciler enqueues it later.
    transaction.on_commit(
        lambda: queues.enqueue_control("jobs.tasks.validate_batch", batch_id, suffix="validate"),
        robust=True)
    return batch


def get_batch_for_user(*, owner: Any, batch_id: str) -> Batch:
    batch = (Batch.objects.filter(owner=owner, pk=batch_id).first()
             if storable_id(batch_id) else None)
    if batch is None:
        raise not_found("batch", batch_id)
    return batch


def refresh_progress(*, batch_id: str) -> None:
    """Copy the sums of the batch's shard counters onto its row (Batch.completed and the
    rest). Called after every change to a shard's counters; the shards stay the truth.

    The batch row is locked first, so that of two workers refreshing at once the later sum
    is written last (PostgreSQL: the UPDATE then sees every shard write committed before
    the lock was granted; SQLite's IMMEDIATE transactions run one writer at a time)."""
    shards = Shard.objects.filter(batch=OuterRef("pk")).order_by().values("batch")
    with transaction.atomic():
        locked = Batch.objects.select_for_update().filter(pk=batch_id)
        if not locked.values_list("pk", flat=True):
            return
        locked.update(**{k: Coalesce(Subquery(shards.annotate(total=Sum(k)).values("total")), 0)
                         for k in PROGRESS_FIELDS})


# --- scheduling (fair share) ---

# Shards of one batch waiting in Redis at a time. The rest wait in the database, so a small
# batch submitted behind a huge one gets its shards in line after a couple of the huge one's,
# not after all of them: queues interleave batches instead of running them FIFO.
QUEUED_PER_BATCH = 2


def enqueue_next_shards(*, batch_id: str) -> int:
    """Top up the batch's shards waiting in Redis to QUEUED_PER_BATCH. Returns how many
    jobs were created."""
    batch = Batch.objects.filter(pk=batch_id).only("status", "stop_code").first()
    if batch is None or batch.status != Batch.Status.IN_PROGRESS or batch.stop_code:
        return 0
    waiting = Shard.objects.filter(batch_id=batch_id, status=Shard.Status.QUEUED,
                                   enqueued_at__isnull=False).count()
    room = QUEUED_PER_BATCH - waiting
    if room <= 0:
        return 0
    now = timezone.now()
    ready = (Shard.objects.filter(batch_id=batch_id, status=Shard.Status.QUEUED,
                                  enqueued_at__isnull=True)
             .filter(Q(not_before__isnull=True) | Q(not_before__lte=now))
             .order_by("index").values_list("pk", "queue_name")[:room])
    created = 0
    for shard_id, queue_name in ready:
        if Shard.objects.filter(pk=shard_id, status=Shard.Status.QUEUED,
                                enqueued_at__isnull=True).update(enqueued_at=now):
            queues.enqueue_shard(shard_id, queue_name)
            created += 1
    return created


# --- stopping early ---


def cancel_batch(*, batch: Batch) -> Batch:
    """Ask a validating or running batch to stop: status `cancelling` at once; queued shards
    are dropped, workers abort running ones, and finalization keeps every finished result
    (the rest become `batch_cancelled` error lines). Cancelling twice is harmless; cancelling
    an ended batch is a 409."""
    now = timezone.now()
    with transaction.atomic():
        changed = Batch.objects.filter(
            pk=batch.pk, status__in=(Batch.Status.VALIDATING, Batch.Status.IN_PROGRESS)
        ).update(status=Batch.Status.CANCELLING, cancelling_at=now,
                 stop_code=Code.BATCH_CANCELLED)
        if not changed:
            batch.refresh_from_db()
            if batch.status != Batch.Status.CANCELLING:
                raise wrong_state(f"Cannot cancel a batch that is {batch.status}.")
        _drop_queued_shards(batch.pk, Code.BATCH_CANCELLED)
        batch_id = batch.pk
        transaction.on_commit(lambda: request_finalize(batch_id=batch_id), robust=True)
    return Batch.objects.get(pk=batch.pk)


def expire_due_batches() -> list[str]:
    """Stop every batch whose completion window has closed. Returns their ids."""
    now = timezone.now()
    due = list(Batch.objects.filter(
        status__in=(Batch.Status.VALIDATING, Batch.Status.IN_PROGRESS), stop_code="",
        expires_at__lte=now).values_list("pk", flat=True))
    expired = []
    for batch_id in due:
        with transaction.atomic():
            if not Batch.objects.filter(
                    pk=batch_id, status__in=(Batch.Status.VALIDATING, Batch.Status.IN_PROGRESS),
                    stop_code="").update(stop_code=Code.BATCH_EXPIRED):
                continue
            _drop_queued_shards(batch_id, Code.BATCH_EXPIRED)
        expired.append(batch_id)
        request_finalize(batch_id=batch_id)
    return expired


def _drop_queued_shards(batch_id: str, code: str) -> None:
    # Their jobs may still sit in Redis: a worker that pops one finds the shard abandoned
    # and does nothing.
    from django.db.models import F

    Shard.objects.filter(batch_id=batch_id, status=Shard.Status.QUEUED).update(
        status=Shard.Status.ABANDONED, end_code=code, finished_at=timezone.now(),
        completed=0, failed=F("request_count"), input_tokens=0, output_tokens=0)
    refresh_progress(batch_id=batch_id)


# --- finalization ---


def request_finalize(*, batch_id: str) -> None:
    """Enqueue finalization if nothing of the batch is left to run."""
    if not Shard.objects.filter(batch_id=batch_id, status__in=(
            Shard.Status.QUEUED, Shard.Status.RUNNING)).exists():
        queues.enqueue_control("jobs.tasks.finalize_batch", batch_id, suffix="finalize")


FINALIZE_STALE_AFTER = timedelta(minutes=10)


def finalize_batch(*, batch_id: str) -> Batch | None:
    """Merge the shards' parts into the output and error files and end the batch.

    Idempotent: it does nothing while shards still run or once the batch has ended, and a
    finalizer that died half-way is replaced after FINALIZE_STALE_AFTER (its files, never
    attached to the batch, are orphans for cleanup).
    """
    batch = Batch.objects.filter(pk=batch_id).first()
    if batch is None or batch.is_ended:
        return batch
    if batch.stop_code:
        _drop_queued_shards(batch_id, batch.stop_code)
    elif batch.status != Batch.Status.IN_PROGRESS:
        return batch
    if Shard.objects.filter(batch_id=batch_id,
                            status__in=(Shard.Status.QUEUED, Shard.Status.RUNNING)).exists():
        return batch
    now = timezone.now()
    claim = Batch.objects.filter(pk=batch_id).exclude(status__in=Batch.ENDED).filter(
        Q(finalize_claimed_at__isnull=True) | Q(finalize_claimed_at__lt=now - FINALIZE_STALE_AFTER))
    if not batch.stop_code:
        if not claim.update(status=Batch.Status.FINALIZING, finalizing_at=now,
                            finalize_claimed_at=now):
            return batch
    elif not claim.update(finalize_claimed_at=now):
        return batch
    refresh_progress(batch_id=batch_id)  # every shard has ended: the final counts
    batch.refresh_from_db()

    output_file, error_file = _merge_parts(batch)
    ending = {
        "": (Batch.Status.COMPLETED, "completed_at"),
        Code.BATCH_CANCELLED: (Batch.Status.CANCELLED, "cancelled_at"),
        Code.BATCH_EXPIRED: (Batch.Status.EXPIRED, "expired_at"),
    }[batch.stop_code]
    status, stamp = ending
    ended = Batch.objects.filter(pk=batch_id, finalize_claimed_at=now).update(
        status=status, output_file=output_file, error_file=error_file,
        **{stamp: timezone.now()})
    if not ended:
        # Another finalizer took over: our files are not the batch's.
        for file in (output_file, error_file):
            if file is not None:
                from jobs.services.files import delete_file

                delete_file(file=file)
        return Batch.objects.get(pk=batch_id)
    _notify_ended(batch_id)
    return Batch.objects.get(pk=batch_id)


def _merge_parts(batch: Batch) -> tuple[File | None, File | None]:
    """Concatenate the parts in shard order into two new Files, streamed."""
    expires_at = (timezone.now() + timedelta(seconds=batch.output_expires_after)
                  if batch.output_expires_after else None)
    with local_temp(".out") as out_path, local_temp(".err") as err_path:
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            for shard in Shard.objects.filter(batch=batch).order_by("index").iterator():
                if shard.status == Shard.Status.DONE:
                    _append_stored(out, shard.output_part)
                    _append_stored(err, shard.error_part)
                else:
                    for line in unrun_lines(shard, code=shard.end_code or Code.SHARD_FAILED,
                                            reason=shard.last_error):
                        err.write(line)
        files = []
        for path, purpose, suffix in ((out_path, File.Purpose.BATCH_OUTPUT, "output"),
                                      (err_path, File.Purpose.BATCH_ERROR, "error")):
            if path.stat().st_size == 0:
                files.append(None)
                continue
            files.append(store_file(owner=batch.owner, source_path=path,
                                    filename=f"{batch.id}_{suffix}.jsonl", purpose=purpose,
                                    expires_at=expires_at))
    return files[0], files[1]


def _append_stored(target: IO[bytes], storage_name: str) -> None:
    if not storage_name:
        return
    from django.core.files.storage import default_storage

    with default_storage.open(storage_name, "rb") as source:
        while chunk := source.read(1024 * 1024):
            target.write(chunk)


def unrun_lines(shard: Shard, *, code: str, reason: str = "") -> Iterator[bytes]:
    """Error lines for every request a shard is responsible for, streamed from its input
    range: for shards that never finished (dropped on cancel or expiry, or out of retries)."""
    message = STOP_MESSAGES.get(code) or f"The request could not be run: {reason or 'unknown'}"
    for custom_id in shard_custom_ids(shard):
        yield failure_line(custom_id, code, message)


def shard_custom_ids(shard: Shard) -> Iterator[str]:
    """The custom_ids a shard answers for: its lines that are not copies, then the copies of
    its primaries."""
    last_line = shard_last_line(shard)
    skip = set(RequestCopy.objects.filter(batch_id=shard.batch_id, line__gte=shard.first_line,
                                          line__lte=last_line).values_list("line", flat=True))
    batch = Batch.objects.only("input_file").get(pk=shard.batch_id)
    with open_range_lines(batch.input_file.storage_name, start=shard.start_byte,
                          end=shard.end_byte, first_number=shard.first_line) as lines:
        for line in lines:
            if line.content is None or not line.content.strip() or line.number in skip:
                continue
            yield json.loads(line.content)["custom_id"]
    yield from RequestCopy.objects.filter(
        batch_id=shard.batch_id, primary_line__gte=shard.first_line,
        primary_line__lte=last_line).values_list("custom_id", flat=True).iterator()


def shard_last_line(shard: Shard) -> int:
    """The number of a shard's last input line (the next shard's first line - 1)."""
    nxt = Shard.objects.filter(batch_id=shard.batch_id, index=shard.index + 1).values_list(
        "first_line", flat=True).first()
    return (nxt - 1) if nxt else 2**31 - 1


def _notify_ended(batch_id: str) -> None:
    """A batch ended: record its webhook event and enqueue the delivery (an RQ job on the
    control queue, ids only); the HTTP call never runs here. A failure to notify must not
    fail the finalizer: the event, once recorded, is retried by the reconciler."""
    log.info("batch %s ended", batch_id)
    try:
        from jobs.services.webhooks import batch_ended

        batch_ended(batch_id=batch_id)
    except Exception:
        log.exception("could not record the webhook event of batch %s", batch_id)
