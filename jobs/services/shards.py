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
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from jobs.models import PROGRESS_FIELDS, Batch, Shard
from jobs.services.ledger import ShardUsage, record_shard_usage
from jobs.services.progress import refresh_progress
from jobs.services.scheduling import enqueue_next_shards, request_finalize
from jobs.wire import Code

log = logging.getLogger(__name__)


@dataclass
class Progress:
    completed: int = 0
    failed: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0  # of input_tokens, those served from the engine's prefix cache
    cacheable_tokens: int = 0  # of input_tokens, the most a prefix cache could serve

    def as_fields(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in PROGRESS_FIELDS}


# The kinds of part a shard attempt writes, in the order of a checkpoint segment's names.
PART_KINDS = ("output", "error", "flags")


@dataclass
class Checkpoint:
    """The results an attempt saved so far: its part files' stored segments, in order
    (each an (output, error, flags) triple of storage names, "" for nothing new), the input
    lines they answer, and the counters they carry."""

    attempt: int = 0
    segments: list[tuple[str, str, str]] = field(default_factory=list)
    lines: set[int] = field(default_factory=set)
    progress: Progress = field(default_factory=Progress)
    flag_counts: dict[str, int] = field(default_factory=dict)
    json_retries: int = 0
    usage: ShardUsage = field(default_factory=ShardUsage)

    def as_json(self) -> dict[str, Any]:
        return {"attempt": self.attempt, "segments": [list(s) for s in self.segments],
                "lines": _ranges(self.lines), "progress": self.progress.as_fields(),
                "flag_counts": self.flag_counts, "json_retries": self.json_retries,
                "usage": self.usage.as_json()}

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> Checkpoint:
        if not value:
            return cls()
        return cls(attempt=value["attempt"],
                   segments=[(out, err, flags) for out, err, flags in value["segments"]],
                   lines={line for first, last in value["lines"]
                          for line in range(first, last + 1)},
                   progress=Progress(**value["progress"]),
                   flag_counts=dict(value["flag_counts"]), json_retries=value["json_retries"],
                   usage=ShardUsage.from_json(value.get("usage")))

    def names_of(self, kind: str) -> list[str]:
        """The stored segments of one kind of part (PART_KINDS), in order."""
        index = PART_KINDS.index(kind)
        return [segment[index] for segment in self.segments if segment[index]]

    def storage_names(self) -> list[str]:
        return [name for segment in self.segments for name in segment if name]


def _ranges(lines: set[int]) -> list[list[int]]:
    # Results finish roughly in line order: a shard's lines fold into a few [first, last].
    ranges: list[list[int]] = []
    for line in sorted(lines):
        if ranges and ranges[-1][1] == line - 1:
            ranges[-1][1] = line
        else:
            ranges.append([line, line])
    return ranges


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
    # The new attempt starts from the counters of the checkpoint it adopts. Only a running
    # attempt writes a checkpoint, so while the shard is queued under this attempt number
    # (what the UPDATE checks) the checkpoint read here is the one the row holds.
    adopted = Checkpoint.from_json(shard.checkpoint).progress
    counters_change = adopted != Progress(**{k: getattr(shard, k) for k in adopted.as_fields()})
    claimed_fields = {"status": Shard.Status.RUNNING, "attempt": shard.attempt + 1,
                      "worker": worker, "heartbeat_at": now, "started_at": now,
                      "finished_at": None, "enqueued_at": None, "computed_unsaved": 0,
                      **adopted.as_fields()}
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


def heartbeat(*, shard_id: str, attempt: int, progress: Progress, unsaved: int = 0,
              batch_id: str = "") -> tuple[bool, str]:
    """Record that the worker is alive, how far it got, and how many of the requests it
    computed its checkpoint does not hold yet. Returns (still ours, the batch's stop code:
    non-empty when the shard must stop). `batch_id`: the shard's, when the caller knows it
    (one read less)."""
    batch_id = batch_id or Shard.objects.filter(pk=shard_id).values_list(
        "batch_id", flat=True).first() or ""
    with transaction.atomic():
        mine = Shard.objects.filter(pk=shard_id, attempt=attempt,
                                    status=Shard.Status.RUNNING).update(
            heartbeat_at=timezone.now(), computed_unsaved=unsaved, **progress.as_fields())
        if mine and batch_id:
            refresh_progress(batch_id=batch_id)
    stop_code = (Batch.objects.filter(pk=batch_id).values_list("stop_code", flat=True)
                 .first() or "")
    return bool(mine), stop_code


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
                cached_tokens=0, cacheable_tokens=0)
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
