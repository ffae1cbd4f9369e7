"""Stopping a batch early: cancelled by its owner (or an operator), or expired when its
completion window closes. Queued shards are dropped at once, workers abort running ones,
finalization keeps every finished result, and each request that never ran becomes a
`batch_cancelled` / `batch_expired` error line (`unrun_lines`)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from jobs.formats.wire import MAX_MESSAGE_CHARS, Code, custom_id_of, failure_line, unrun_message
from jobs.lib.errors import wrong_state
from jobs.models import Batch, File, Shard
from jobs.services.progress import refresh_progress
from jobs.services.scheduling import request_finalize
from jobs.services.shard_input import shard_custom_ids
from jobs.storage.external import ObjectChanged
from jobs.storage.lines import iter_lines
from jobs.storage.objects import open_file

log = logging.getLogger(__name__)


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
        drop_queued_shards(batch.pk, Code.BATCH_CANCELLED)
        batch_id = batch.pk
        transaction.on_commit(lambda: request_finalize(batch_id=batch_id), robust=True)
    return Batch.objects.get(pk=batch.pk)


def expire_due_batches() -> list[str]:
    """Stop every batch whose completion window has closed. Returns their ids."""
    now = timezone.now()
    due = list(Batch.objects.accepting_work().filter(expires_at__lte=now)
               .values_list("pk", flat=True))
    expired = []
    for batch_id in due:
        with transaction.atomic():
            if not Batch.objects.accepting_work().filter(pk=batch_id).update(
                    stop_code=Code.BATCH_EXPIRED):
                continue
            drop_queued_shards(batch_id, Code.BATCH_EXPIRED)
        expired.append(batch_id)
        request_finalize(batch_id=batch_id)
    return expired


def stop_changed_input(*, batch_id: str, reason: str) -> bool:
    """The batch's input file, read in place from its owner's bucket, is no longer the
    version that was registered (a shard or validation found it replaced). The batch stops
    as an expired one does (queued shards dropped, running ones aborted, finished results
    kept, all of them computed on the registered version) and ends `failed`, the reason in
    `errors.data`: nothing runs on other data. False when it was stopping already."""
    entry = {"code": Code.INPUT_CHANGED, "line": None, "param": None,
             "message": reason[:MAX_MESSAGE_CHARS]}
    with transaction.atomic():
        if not Batch.objects.accepting_work().filter(pk=batch_id).update(
                stop_code=Code.INPUT_CHANGED, errors=[entry]):
            return False
        drop_queued_shards(batch_id, Code.INPUT_CHANGED)
    request_finalize(batch_id=batch_id)
    return True


def drop_queued_shards(batch_id: str, code: str) -> None:
    """End the batch's queued shards with `code`, all their requests counted failed."""
    # Their jobs may still sit in Redis: a worker that pops one finds the shard abandoned
    # and does nothing.
    Shard.objects.filter(batch_id=batch_id, status=Shard.Status.QUEUED).update(
        status=Shard.Status.ABANDONED, end_code=code, finished_at=timezone.now(),
        completed=0, failed=F("request_count"), input_tokens=0, output_tokens=0,
        cached_tokens=0, cacheable_tokens=0, reasoning_tokens=0)
    refresh_progress(batch_id=batch_id)


def unrun_lines(shard: Shard, *, code: str, reason: str = "") -> Iterator[bytes]:
    """Error lines for every request a shard is responsible for, streamed from its input
    range: for shards that never finished (dropped on cancel or expiry, or out of retries).
    None when the input, read in place from its owner's bucket, has changed since: its
    requests can no longer be named (the batch's request_counts still count them)."""
    message = unrun_message(code, reason)
    try:
        for custom_id in shard_custom_ids(shard):
            yield failure_line(custom_id, code, message)
    except ObjectChanged:  # raised when the input is opened, before any line
        log.warning("shard %s: its input changed; its unrun requests get no lines", shard.pk)


class UnstartedLines:
    """Error lines for every request of a batch stopped while it was still validating
    (nothing of it ran, no shard exists): one `code` line for each custom_id of its input
    file, the first time it appears, streamed. `count` is how many were written, once
    read to the end: the batch's total and failed requests."""

    def __init__(self, batch: Batch, *, code: str) -> None:
        self.batch = batch
        self.message = unrun_message(code)
        self.code = code
        self.count = 0

    def __iter__(self) -> Iterator[bytes]:
        file = File.objects.filter(pk=self.batch.input_file_id).first()
        if file is None:
            return
        # Imported here: numpy is not loaded by a worker's start (tests/ops/test_startup.py).
        from jobs.lib.digestset import DigestSet

        seen = DigestSet()
        self.count = 0
        try:
            stream = open_file(file)
        except ObjectChanged:  # read in place and replaced since: nothing to name
            return
        with stream:
            for line in iter_lines(stream, max_line_bytes=settings.BATCHWEB["MAX_LINE_BYTES"]):
                custom_id = custom_id_of(line.content)
                if custom_id is None or not seen.add_new(custom_id):
                    continue
                self.count += 1
                yield failure_line(custom_id, self.code, self.message)
