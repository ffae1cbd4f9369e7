"""Results delivered to the prefix a batch's owner named (`output_prefix`, a folder of
their own bucket granted to them for writing, jobs.services.grants), besides the Files API:
once the batch has ended, its output and error files are copied there as
`<prefix><batch_id>_output.jsonl` and `<prefix><batch_id>_errors.jsonl`, streamed from
storage into a multipart upload (a part in memory at a time, never the whole file).

The File rows stay what they are, and download as usual: a delivery that fails loses
nothing. Its reason is recorded on the batch (`delivery_error`, shown in its object and
page) and the reconciler retries it with a backoff (DELIVERY_RETRY_BASE_SECONDS doubling,
DELIVERY_MAX_ATTEMPTS in all); an operator may ask for it once more later (the admin's
action). One attempt runs at a time: each claims the batch by a conditional UPDATE of
`delivery_next_at`, which a killed attempt's claim outlives only until CONTROL_JOB_TIMEOUT.
The grant is checked again at each attempt: a revoked one stops deliveries there.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from django.conf import settings
from django.db.models import F, Q
from django.utils import timezone

from jobs.lib import queues
from jobs.lib.errors import ServiceError
from jobs.models import Batch, File
from jobs.services.grants import reach
from jobs.storage.backends import CHUNK
from jobs.storage.external import S3Location, open_writer, shown_reason
from jobs.storage.objects import open_file

log = logging.getLogger(__name__)

WAITING = (Batch.DeliveryStatus.PENDING, Batch.DeliveryStatus.FAILED)
SUFFIXES = (("output_file_id", "_output.jsonl"), ("error_file_id", "_errors.jsonl"))


def deliver_results(*, batch_id: str) -> bool:
    """One attempt to deliver an ended batch's files to its output_prefix. True when they
    are there now; False when it failed (recorded, retried later) or was not due (not
    ended, nothing asked, delivered already, or another attempt running)."""
    now = timezone.now()
    claim_until = now + timedelta(seconds=settings.BATCHWEB["CONTROL_JOB_TIMEOUT"])
    if not Batch.objects.filter(pk=batch_id, status__in=Batch.ENDED,
                                delivery_status__in=WAITING).filter(
            Q(delivery_next_at__isnull=True) | Q(delivery_next_at__lte=now)).update(
            delivery_next_at=claim_until):
        return False
    batch = Batch.objects.select_related("owner").get(pk=batch_id)
    try:
        written = _write(batch)
    except Exception as exc:
        _failed(batch, exc)
        return False
    Batch.objects.filter(pk=batch_id).update(
        delivery_status=Batch.DeliveryStatus.DELIVERED, delivered_at=timezone.now(),
        delivery_error="", delivery_next_at=None, delivery_attempts=F("delivery_attempts") + 1)
    log.info("batch %s: results delivered to %s", batch_id, ", ".join(written) or "nothing")
    return True


def _write(batch: Batch) -> list[str]:
    """Each file the batch has, streamed to its object under the prefix. Returns their
    URLs."""
    place = reach(owner=batch.owner, url=batch.output_prefix, access="write",
                  param="output_prefix", folder=True)
    written = []
    for field, suffix in SUFFIXES:
        file_id = getattr(batch, field)
        if not file_id:
            continue  # no lines of that kind (a failed validation has neither)
        file = File.objects.filter(pk=file_id).first()
        if file is None:
            raise ServiceError(f"its file {file_id} is gone (deleted or expired): nothing "
                               "to deliver.")
        target = S3Location(place.location.bucket,
                            f"{place.location.key}{batch.id}{suffix}")
        # An exception inside aborts the multipart upload: nothing half-written appears.
        with open_file(file) as stream, open_writer(
                target, credentials=place.credentials) as writer:
            while chunk := stream.read(CHUNK):
                writer.write(chunk)
        written.append(target.url)
    return written


def _failed(batch: Batch, exc: Exception) -> None:
    conf = settings.BATCHWEB
    attempts = batch.delivery_attempts + 1
    # The batch's object and page show the reason: never the storage's address, which the
    # log keeps for the operator (jobs.storage.external.shown_reason).
    reason = exc.message if isinstance(exc, ServiceError) else shown_reason(exc)
    retry = attempts < conf["DELIVERY_MAX_ATTEMPTS"]
    log.warning("batch %s: delivery to %s failed (attempt %d%s): %s: %s", batch.pk,
                batch.output_prefix, attempts, "" if retry else ", the last",
                type(exc).__name__, exc)
    # Never over a success (an operator's retry may have run beside this attempt).
    Batch.objects.filter(pk=batch.pk).exclude(
        delivery_status=Batch.DeliveryStatus.DELIVERED).update(
        delivery_status=Batch.DeliveryStatus.FAILED, delivery_error=reason[:2000],
        delivery_attempts=attempts,
        delivery_next_at=(timezone.now() + timedelta(
            seconds=conf["DELIVERY_RETRY_BASE_SECONDS"] * 2 ** (attempts - 1))
            if retry else None))


def enqueue_due() -> int:
    """The reconciler's share: a delivery job for each ended batch whose delivery is due
    (a retry after its backoff, or a first attempt its finalizer did not make). Returns how
    many were enqueued."""
    now = timezone.now()
    due = Batch.objects.filter(status__in=Batch.ENDED, delivery_status__in=WAITING,
                               delivery_attempts__lt=settings.BATCHWEB["DELIVERY_MAX_ATTEMPTS"]
                               ).filter(Q(delivery_next_at__lte=now)
                                        | Q(delivery_next_at__isnull=True,
                                            delivery_status=Batch.DeliveryStatus.PENDING))
    count = 0
    for batch_id in due.values_list("pk", flat=True)[:100]:
        if not queues.job_is_waiting(f"{batch_id}-deliver", queues.CONTROL_QUEUE):
            queues.enqueue_control("jobs.tasks.deliver_results", batch_id, suffix="deliver")
            count += 1
    return count


def deliver_again(*, batch: Batch) -> bool:
    """An operator's retry of a failed delivery (after its attempts ran out, or before its
    next one): attempts counted from zero again, a job now. False when the batch has no
    delivery waiting."""
    if not Batch.objects.filter(pk=batch.pk, status__in=Batch.ENDED,
                                delivery_status__in=WAITING).update(
            delivery_attempts=0, delivery_next_at=timezone.now()):
        return False
    queues.enqueue_control("jobs.tasks.deliver_results", batch.pk, suffix="deliver")
    return True
