"""Ending a batch: once nothing of it is left to run, merge its shards' parts into the
output and error Files (the requests of shards that never finished become error lines),
set its final status, record its webhook event and, where its owner named an
output_prefix, deliver the files there (jobs.services.delivery)."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from django.db.models import Q
from django.utils import timezone

from jobs.formats.wire import Code
from jobs.models import Batch, File, Shard
from jobs.services.delivery import deliver_results
from jobs.services.files import delete_file, store_concatenated
from jobs.services.progress import refresh_progress
from jobs.services.stopping import UnstartedLines, drop_queued_shards, unrun_lines
from jobs.storage.backends import Source

log = logging.getLogger(__name__)

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
        drop_queued_shards(batch_id, batch.stop_code)
    elif batch.status != Batch.Status.IN_PROGRESS:
        return batch
    if Shard.objects.in_line().filter(batch_id=batch_id).exists():
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

    counts: dict[str, int] = {}
    if batch.in_progress_at is None:
        # Stopped while validating: no shard exists, and every request is still owed its
        # line (Anthropic's contract, and the one promise of both faces: each custom_id
        # once in the results).
        unstarted = UnstartedLines(batch, code=batch.stop_code)
        output_file, error_file = None, _store_errors(batch, [unstarted])
        counts = {"total": unstarted.count, "failed": unstarted.count}
    else:
        output_file, error_file = _merge_parts(batch)
    ending = {
        "": (Batch.Status.COMPLETED, "completed_at"),
        Code.BATCH_CANCELLED: (Batch.Status.CANCELLED, "cancelled_at"),
        Code.BATCH_EXPIRED: (Batch.Status.EXPIRED, "expired_at"),
        # Its input changed in its owner's bucket (stopping.stop_changed_input, which
        # wrote the reason to errors.data): the results computed before are kept.
        Code.INPUT_CHANGED: (Batch.Status.FAILED, "failed_at"),
    }[batch.stop_code]
    status, stamp = ending
    ended = Batch.objects.filter(pk=batch_id, finalize_claimed_at=now).update(
        status=status, output_file=output_file, error_file=error_file,
        **{stamp: timezone.now()}, **counts)
    if not ended:
        # Another finalizer took over: our files are not the batch's.
        for file in (output_file, error_file):
            if file is not None:
                delete_file(file=file)
        return Batch.objects.get(pk=batch_id)
    notify_ended(batch_id)
    if batch.output_prefix:
        # Its files to the owner's bucket too (a failure is recorded and retried; the
        # Files API has them whatever happens).
        deliver_results(batch_id=batch_id)
    return Batch.objects.get(pk=batch_id)


def _merge_parts(batch: Batch) -> tuple[File | None, File | None]:
    """Join the parts in shard order into two new Files inside the storage (server-side
    copies on S3), with the error lines of shards that never finished streamed in between."""
    outputs: list[Source] = []
    errors: list[Source] = []
    for shard in Shard.objects.filter(batch=batch).order_by("index").iterator():
        if shard.status == Shard.Status.DONE:
            if shard.output_part:
                outputs.append(shard.output_part)
            if shard.error_part:
                errors.append(shard.error_part)
        else:
            errors.append(unrun_lines(shard, code=shard.end_code or Code.SHARD_FAILED,
                                      reason=shard.last_error))
    output = store_concatenated(owner=batch.owner, sources=outputs,
                                filename=f"{batch.id}_output.jsonl",
                                purpose=File.Purpose.BATCH_OUTPUT,
                                expires_at=_output_expiry(batch))
    return output, _store_errors(batch, errors)


def _store_errors(batch: Batch, sources: list[Source]) -> File | None:
    return store_concatenated(owner=batch.owner, sources=sources,
                              filename=f"{batch.id}_error.jsonl",
                              purpose=File.Purpose.BATCH_ERROR,
                              expires_at=_output_expiry(batch))


def _output_expiry(batch: Batch) -> datetime | None:
    return (timezone.now() + timedelta(seconds=batch.output_expires_after)
            if batch.output_expires_after else None)


def notify_ended(batch_id: str) -> None:
    """A batch ended: record its webhook event and enqueue the delivery (an RQ job on the
    control queue, ids only; the HTTP call never runs here), and settle the eval runs
    waiting for it. A failure to notify must not fail the finalizer: the event, once
    recorded, is retried by the reconciler."""
    log.info("batch %s ended", batch_id)
    try:
        from jobs.services.webhooks import batch_ended

        batch_ended(batch_id=batch_id)
    except Exception:
        log.exception("could not record the webhook event of batch %s", batch_id)
    # Eval runs waiting for this batch (or this batch being one's requests) are scored.
    from jobs.services import evals

    evals.batch_ended(batch_id=batch_id)
