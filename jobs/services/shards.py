"""Shard state: claimed by one worker at a time, fenced by the attempt number.

A worker may only write (progress, checkpoints, results, failure) under the attempt it
claimed: every write is `UPDATE ... WHERE id = %s AND attempt = %s AND status = 'running'`,
so a worker presumed dead that wakes up later changes nothing.

A running attempt checkpoints its finished results (`record_checkpoint`); the checkpoint
stays on the row when the attempt ends unfinished (handed back, failed, its worker lost),
and the claim that starts the next attempt hands it on: that attempt adopts those results
and their counters, and computes only the lines without a result.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.core.files.storage import default_storage
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from jobs.formats.checkpoint_record import Checkpoint, Progress, ShardUsage
from jobs.formats.wire import Code
from jobs.models import Batch, Shard
from jobs.services.ledger import record_shard_usage
from jobs.services.progress import refresh_progress
from jobs.services.scheduling import enqueue_next_shards, request_finalize

log = logging.getLogger(__name__)


def claim_shard(*, shard_id: str, worker: str, top_up: bool = True) -> Shard | None:
    """Take a queued shard of a running batch for this worker; None when it is not ours to
    run (already done, taken, dropped, or its batch stopped). Tops up the batch's queue,
    unless `top_up` is False: then the caller must (`enqueue_next_shards`), soon, or the
    batch's next shards wait for the reconciler."""
    shard = (Shard.objects.select_related("batch", "batch__input_file")
             .filter(pk=shard_id).first())
    if shard is None or shard.status != Shard.Status.QUEUED:
        return None
    batch = shard.batch
    if batch.status != Batch.Status.IN_PROGRESS or batch.stop_code:
        return None
    now = timezone.now()
    # The new attempt starts from the checkpoint the row holds, and from its counters. Only
    # a running attempt writes a checkpoint, so while the shard is queued under this attempt
    # number (what the UPDATE checks) the checkpoint read here is the one the row holds.
    checkpoint = Checkpoint.from_json(shard.checkpoint)
    lost = _lost_segments(checkpoint)
    if lost:
        # Its segments are read only when the shard finishes, so a lost one would fail
        # every later attempt: the row forgets the checkpoint and the attempt runs whole.
        log.warning("shard %s: checkpoint segment %s is not in storage; running it whole",
                    shard_id, lost[0])
        checkpoint = Checkpoint()
    adopted = checkpoint.progress
    counters_change = adopted != Progress(**{k: getattr(shard, k) for k in adopted.as_fields()})
    claimed_fields: dict[str, object] = {
        "status": Shard.Status.RUNNING, "attempt": shard.attempt + 1, "worker": worker,
        "heartbeat_at": now, "started_at": now, "finished_at": None, "enqueued_at": None,
        "computed_unsaved": 0, **adopted.as_fields()}
    if lost:
        claimed_fields["checkpoint"] = {}
    # The claim is this one UPDATE, in one transaction with the batch's counters when they
    # change: a connection dropped before it commits undoes all of it, and the caller's
    # retry claims again instead of finding the shard already running.
    with transaction.atomic() if counters_change else nullcontext():
        claimed = Shard.objects.filter(pk=shard_id, status=Shard.Status.QUEUED,
                                       attempt=shard.attempt).update(**claimed_fields)
        if claimed and counters_change:
            refresh_progress(batch_id=shard.batch_id)
    if not claimed:
        return None
    if top_up:
        batch_id = shard.batch_id
        transaction.on_commit(lambda: enqueue_next_shards(batch_id=batch_id), robust=True)
    # The row holds what the UPDATE wrote: so does the object read above, without a
    # second read.
    for name, value in claimed_fields.items():
        setattr(shard, name, value)
    return shard


def _lost_segments(checkpoint: Checkpoint) -> list[str]:
    return [name for name in checkpoint.storage_names() if not default_storage.exists(name)]


@dataclass(frozen=True)
class Beat:
    """What a heartbeat records of one attempt: how far it got (`progress`) and how many
    of the requests it computed its checkpoint does not hold yet (`unsaved`; None: left as
    the last checkpoint recorded it). `moved`: False when `progress` is what this
    attempt's last heartbeat wrote, so the batch's sums cannot have changed by it."""

    shard_id: str
    attempt: int
    batch_id: str
    progress: Progress
    unsaved: int | None = 0
    moved: bool = True


def heartbeats(*, beats: Sequence[Beat]) -> tuple[set[str], dict[str, str]]:
    """Record that a worker is alive with each of its attempts' progress, in one
    transaction. Returns the shards still its own and each batch's stop code (non-empty
    when its shards must stop). A batch's sums are refreshed and its stop code read once,
    however many of its shards beat: a worker with several shards of one batch made as
    many of each a beat."""
    mine: set[str] = set()
    now = timezone.now()
    with transaction.atomic():
        # Rows locked in one order (shards, then batches): another transaction taking
        # several of them never waits on this one in a circle.
        for beat in sorted(beats, key=lambda b: b.shard_id):
            counts = {} if beat.unsaved is None else {"computed_unsaved": beat.unsaved}
            if Shard.objects.filter(pk=beat.shard_id, attempt=beat.attempt,
                                    status=Shard.Status.RUNNING).update(
                    heartbeat_at=now, **counts, **beat.progress.as_fields()):
                mine.add(beat.shard_id)
        for batch_id in sorted({b.batch_id for b in beats
                                if b.moved and b.shard_id in mine}):
            refresh_progress(batch_id=batch_id)
        stop_codes = dict(Batch.objects.filter(
            pk__in={b.batch_id for b in beats}).values_list("pk", "stop_code"))
    return mine, stop_codes


def record_checkpoint(*, shard_id: str, attempt: int, checkpoint: Checkpoint,
                      unsaved: int = 0) -> bool:
    """Record an attempt's checkpoint (its segments already stored). False when the
    attempt is no longer the running one: the caller must then delete the segments it
    stored for this checkpoint (the earlier ones are the row's, kept for the next attempt)."""
    return bool(Shard.objects.filter(pk=shard_id, attempt=attempt,
                                     status=Shard.Status.RUNNING).update(
        checkpoint=checkpoint.as_json(), computed_unsaved=unsaved))


def finish_shard(*, shard_id: str, attempt: int, output_part: str, error_part: str,
                 progress: Progress, flags_part: str = "",
                 flag_counts: dict[str, int] | None = None, json_retries: int = 0,
                 usage: ShardUsage | None = None) -> bool:
    """Record a shard's results as complete and charge them (the usage ledger, in the same
    transaction: charged exactly when the results become the shard's). False when the
    attempt is no longer the current one (the caller must then discard its parts).
    Enqueues finalization when this was the batch's last shard. The parts hold the adopted
    checkpoint's results too: the checkpoint is cleared (the caller deletes its segments)."""
    with transaction.atomic():
        done = Shard.objects.filter(pk=shard_id, attempt=attempt,
                                    status=Shard.Status.RUNNING).update(
            status=Shard.Status.DONE, finished_at=timezone.now(), output_part=output_part,
            error_part=error_part, flags_part=flags_part, flag_counts=flag_counts or {},
            json_retries=json_retries, last_error="", checkpoint={}, computed_unsaved=0,
            **progress.as_fields())
        if done:
            record_shard_usage(shard_id=shard_id, progress=progress, usage=usage)
            batch_id = _refresh_batch_progress(shard_id)
            transaction.on_commit(lambda: request_finalize(batch_id=batch_id), robust=True)
    return bool(done)


def fail_shard(*, shard_id: str, attempt: int, reason: str) -> None:
    """An attempt failed (engine error, lost worker, storage error). Retry after an
    exponential backoff, or once out of attempts abandon the shard: its requests become
    `shard_failed` error lines and the batch still completes."""
    conf = settings.BATCHWEB
    shard = Shard.objects.filter(pk=shard_id, attempt=attempt,
                                 status=Shard.Status.RUNNING).first()
    if shard is None:
        return
    failures = shard.failures + 1
    reason = reason[:2000]
    fenced = Shard.objects.filter(pk=shard_id, attempt=attempt, status=Shard.Status.RUNNING)
    if failures >= conf["SHARD_MAX_ATTEMPTS"]:
        log.warning("shard %s abandoned after %d failures: %s", shard_id, failures, reason)
        with transaction.atomic():
            abandoned = fenced.update(
                status=Shard.Status.ABANDONED, failures=failures, last_error=reason,
                end_code=Code.SHARD_FAILED, finished_at=timezone.now(), completed=0,
                failed=F("request_count"), input_tokens=0, output_tokens=0,
                cached_tokens=0, cacheable_tokens=0, reasoning_tokens=0)
            if abandoned:
                refresh_progress(batch_id=shard.batch_id)
        if abandoned:
            request_finalize(batch_id=shard.batch_id)
        return
    delay = timedelta(seconds=conf["SHARD_RETRY_BASE_SECONDS"] * 2 ** (failures - 1))
    log.warning("shard %s failed (%s); retry %d in %s", shard_id, reason, failures, delay)
    with transaction.atomic():
        # What the attempt computed beyond its checkpoint (as it last reported) is lost: the
        # retry computes it again.
        if fenced.update(status=Shard.Status.QUEUED, failures=failures, last_error=reason,
                         not_before=timezone.now() + delay, worker="",
                         recomputed=F("recomputed") + F("computed_unsaved"),
                         computed_unsaved=0, **_kept_progress(shard).as_fields()):
            refresh_progress(batch_id=shard.batch_id)


def release_shard(*, shard_id: str, attempt: int, unsaved: int = 0) -> None:
    """Hand a running shard back (a worker shutting down) with its checkpoint, which the
    next attempt adopts: it is queued again at once and does not count as a failure.
    `unsaved`: requests the attempt computed that its checkpoint does not hold."""
    shard = Shard.objects.filter(pk=shard_id, attempt=attempt,
                                 status=Shard.Status.RUNNING).first()
    if shard is None:
        return
    with transaction.atomic():
        released = Shard.objects.filter(
            pk=shard_id, attempt=attempt, status=Shard.Status.RUNNING).update(
            status=Shard.Status.QUEUED, worker="", not_before=None,
            recomputed=F("recomputed") + unsaved, computed_unsaved=0,
            **_kept_progress(shard).as_fields())
        batch_id = _refresh_batch_progress(shard_id) if released else ""
    if released:
        enqueue_next_shards(batch_id=batch_id)


def _kept_progress(shard: Shard) -> Progress:
    """The counters a shard keeps while it waits for its next attempt: its checkpoint's
    (the results the next attempt adopts), zero without one."""
    return Checkpoint.from_json(shard.checkpoint).progress


def _refresh_batch_progress(shard_id: str) -> str:
    """After a write to a shard's counters, in the same transaction (a retried call then
    redoes both): the batch's sums follow. Returns the batch id."""
    batch_id = Shard.objects.values_list("batch_id", flat=True).get(pk=shard_id)
    refresh_progress(batch_id=batch_id)
    return batch_id
