"""Batch notifications: when a batch ends, POST an OpenAI-style event to its owner's webhook.

The event, as OpenAI's batch webhooks:
    {"id": "evt_...", "object": "event", "type": "batch.completed", "created_at": 1700000000,
     "data": {"id": "batch_..."}}
with type batch.completed, batch.failed, batch.expired or batch.cancelled; and, as
extensions, batchweb.eval.drift when an eval run of the batch scored below its baseline by
more than its set's threshold (docs/eval-sets.md), and batchweb.batch.at_risk when the
capacity plan first projects the batch past its window (jobs.capacity.plan).

Signed the Standard Webhooks way (as OpenAI's own webhooks, so `openai`'s
`client.webhooks.unwrap(body, headers, secret=...)` verifies it):
    webhook-id:        the event id (the same on every retry: receivers dedupe on it)
    webhook-timestamp: seconds since the epoch when this attempt was sent
    webhook-signature: "v1," + base64(HMAC-SHA256(key, f"{id}.{timestamp}.{body}"))
where key is the base64-decoded part of the user's secret after "whsec_". Signing the id and
timestamp with the body lets receivers refuse replays of old deliveries.

Delivery never runs in the finalizer: the batch's end inserts a WebhookEvent row and
enqueues `jobs.tasks.deliver_webhook(event_id)` on the webhook queue (`queues.WEBHOOK_QUEUE`,
which every batchworker takes after its control and shard queues). An attempt that fails
(connection error, no answer within WEBHOOK_TIMEOUT_SECONDS in all, non-2xx; redirects are
not followed) is retried after WEBHOOK_RETRY_BASE_SECONDS * 2**(attempt-1) by the
reconciler's pass (`enqueue_due`), up to WEBHOOK_MAX_ATTEMPTS. Each attempt is a
WebhookDelivery row (shown in the admin).

At most WEBHOOK_MAX_IN_FLIGHT_PER_USER attempts of one user's events run at once (a Redis
count across all workers): a job beyond that leaves its event due, untouched, and the
reconciler's next pass enqueues it again. So one user's slow receiver ties up that many
workers at most, not every worker taking the webhook queue.

Only allowed addresses are called (settings WEBHOOK_ALLOWED_HOSTS / _NETWORKS), through the
SSRF-safe client in `jobs.lib.safehttp`.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import time
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from jobs.lib import queues
from jobs.lib.safehttp import EXCERPT, Outcome, check_url, post
from jobs.models import Batch, UserSettings, WebhookDelivery, WebhookEvent, new_webhook_secret

log = logging.getLogger(__name__)

EVENT_TYPES = {
    Batch.Status.COMPLETED: "batch.completed",
    Batch.Status.FAILED: "batch.failed",
    Batch.Status.EXPIRED: "batch.expired",
    Batch.Status.CANCELLED: "batch.cancelled",
}
DUE_PER_PASS = 200


# --- per-user settings ---


def settings_for(user: Any) -> UserSettings:
    row, _ = UserSettings.objects.get_or_create(user=user)
    return row


def set_webhook_url(*, user: Any, url: str) -> UserSettings:
    """Set (or clear, with "") the user's webhook URL. Refused unless the operator allows
    the address, so a user learns at once rather than from failed deliveries."""
    url = (url or "").strip()
    if url:
        check_url(url)
    row = settings_for(user)
    row.webhook_url = url
    row.save(update_fields=["webhook_url", "updated_at"])
    return row


def rotate_secret(*, user: Any) -> UserSettings:
    row = settings_for(user)
    row.webhook_secret = new_webhook_secret()
    row.save(update_fields=["webhook_secret", "updated_at"])
    return row


# --- signing ---


def sign(*, secret: str, event_id: str, timestamp: int, body: bytes) -> str:
    key = base64.b64decode(secret.removeprefix("whsec_")) if secret.startswith("whsec_") \
        else secret.encode()
    signed = f"{event_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()


# --- events ---


def batch_ended(*, batch_id: str) -> str | None:
    """Record the event of a batch's end and enqueue its delivery; None when its owner has
    no webhook. Cheap (a few queries and one enqueue): it runs in the finalizer."""
    row = Batch.objects.filter(pk=batch_id).values("owner_id", "status").first()
    if row is None or row["status"] not in EVENT_TYPES:
        return None
    return batch_event(batch_id=batch_id, type=EVENT_TYPES[Batch.Status(row["status"])])


def batch_event(*, batch_id: str, type: str) -> str | None:
    """Record one event of a batch (at most one of each type) and enqueue its delivery;
    None when its owner has no webhook or it was recorded already. Besides OpenAI's end
    events: `batchweb.eval.drift`, an eval run of the batch scored below its baseline
    (jobs.services.evals), and `batchweb.batch.at_risk` (jobs.services.deadlines)."""
    owner_id = Batch.objects.filter(pk=batch_id).values_list("owner_id", flat=True).first()
    if owner_id is None:
        return None
    if not UserSettings.objects.filter(user_id=owner_id).exclude(webhook_url="").exists():
        return None
    try:
        with transaction.atomic():
            event = WebhookEvent.objects.create(
                owner_id=owner_id, batch_id=batch_id, type=type,
                next_attempt_at=timezone.now())
    except IntegrityError:  # already recorded (a repeated finalizer call)
        return None
    event_id = event.pk
    # If Redis is unavailable the event stays due and the reconciler enqueues it later.
    transaction.on_commit(lambda: enqueue_delivery(event_id), robust=True)
    return event_id


def _job_id(event_id: str) -> str:
    return f"{event_id}-webhook"


def enqueue_delivery(event_id: str) -> None:
    # A fixed job id: enqueuing a due event twice keeps one job (though RQ lists its id
    # twice), and the claim in deliver_event makes a duplicate run a no-op anyway.
    queues.queue(queues.WEBHOOK_QUEUE).enqueue(
        "jobs.tasks.deliver_webhook", event_id, job_id=_job_id(event_id),
        job_timeout=int(_lease_seconds()),
        result_ttl=600, failure_ttl=7 * 24 * 3600)


def enqueue_due() -> int:
    """Enqueue the deliveries that are due (new events whose job was lost, retries whose
    backoff has passed, events held back by their user's limit in flight) and not already
    waiting in the queue; returns how many are due. Called by the reconciler's pass."""
    due = list(WebhookEvent.objects.filter(
        status=WebhookEvent.Status.PENDING, next_attempt_at__lte=timezone.now()
    ).order_by("next_attempt_at").values_list("pk", flat=True)[:DUE_PER_PASS])
    # Every worker's reconciler runs this pass: an event held back for a while would
    # otherwise be listed again by each of them, every few seconds.
    waiting = set(queues.queue(queues.WEBHOOK_QUEUE).job_ids) if due else set()
    for event_id in due:
        if _job_id(event_id) not in waiting:
            enqueue_delivery(event_id)
    return len(due)


def retry_delay(attempt: int) -> timedelta:
    return timedelta(seconds=settings.BATCHWEB["WEBHOOK_RETRY_BASE_SECONDS"] * 2 ** (attempt - 1))


def _lease_seconds() -> float:
    """The longest an attempt may take, with room to spare: how long it keeps its event
    claimed and its place among the user's attempts in flight."""
    return settings.BATCHWEB["WEBHOOK_TIMEOUT_SECONDS"] * 4 + 60


def _in_flight_key(owner_id: int) -> str:
    return f"batchweb:webhooks:in-flight:{owner_id}"


# Drop the places of attempts whose lease ran out (their worker died mid-attempt), then
# take a place if fewer than the limit are held. In one script: two workers checking at
# the same instant cannot both take the last place.
_TAKE_PLACE = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[3]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[4])
redis.call('EXPIRE', KEYS[1], ARGV[5])
return 1
"""


def _take_place(owner_id: int, event_id: str) -> bool:
    """A place among the user's attempts in flight (WEBHOOK_MAX_IN_FLIGHT_PER_USER)."""
    now = time.time()
    lease = _lease_seconds()
    take_place = queues.connection().register_script(_TAKE_PLACE)
    taken = take_place(keys=[_in_flight_key(owner_id)], args=[
        now, now + lease, settings.BATCHWEB["WEBHOOK_MAX_IN_FLIGHT_PER_USER"], event_id,
        int(lease) + 1])
    return bool(taken)


def _give_place_back(owner_id: int, event_id: str) -> None:
    queues.connection().zrem(_in_flight_key(owner_id), event_id)


def deliver_event(event_id: str) -> str:
    """One delivery attempt of a due event (the `jobs.tasks.deliver_webhook` job).
    Returns the event's status."""
    due = WebhookEvent.objects.filter(pk=event_id, status=WebhookEvent.Status.PENDING,
                                      next_attempt_at__lte=timezone.now())
    owner_id = due.values_list("owner_id", flat=True).first()
    if owner_id is None:
        event = WebhookEvent.objects.filter(pk=event_id).first()
        return event.status if event else "missing"
    if not _take_place(owner_id, event_id):
        # The user's limit of attempts in flight is reached: the event stays due, and the
        # reconciler's next pass enqueues it again.
        return WebhookEvent.Status.PENDING
    try:
        return _attempt(event_id)
    finally:
        _give_place_back(owner_id, event_id)


def _attempt(event_id: str) -> str:
    conf = settings.BATCHWEB
    now = timezone.now()
    # Claim the attempt: push next_attempt_at past this attempt's longest run, so the
    # reconciler does not enqueue it again meanwhile, and a second job finds nothing due.
    lease = now + timedelta(seconds=_lease_seconds())
    if not WebhookEvent.objects.filter(
            pk=event_id, status=WebhookEvent.Status.PENDING, next_attempt_at__lte=now
    ).update(next_attempt_at=lease, attempts=F("attempts") + 1):
        event = WebhookEvent.objects.filter(pk=event_id).first()
        return event.status if event else "missing"
    event = WebhookEvent.objects.get(pk=event_id)
    attempt = event.attempts
    user_settings = UserSettings.objects.filter(user_id=event.owner_id).first()
    url = user_settings.webhook_url if user_settings else ""
    if user_settings is None or not url:
        outcome = Outcome(ok=False, error="The user has no webhook URL any more.",
                          permanent=True)
        elapsed = 0.0
    else:
        body = json.dumps(event.payload(), separators=(",", ":")).encode()
        timestamp = int(time.time())
        headers = {
            "webhook-id": event.pk,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": sign(secret=user_settings.webhook_secret, event_id=event.pk,
                                      timestamp=timestamp, body=body),
        }
        started = time.monotonic()
        outcome = post(url, body=body, headers=headers)
        elapsed = time.monotonic() - started
    WebhookDelivery.objects.create(
        event=event, attempt=attempt, url=url[:500], duration_ms=int(elapsed * 1000),
        status_code=outcome.status_code, ok=outcome.ok, error=outcome.error,
        response_excerpt=outcome.excerpt[:EXCERPT])
    mine = WebhookEvent.objects.filter(pk=event_id, attempts=attempt,
                                       status=WebhookEvent.Status.PENDING)
    if outcome.ok:
        mine.update(status=WebhookEvent.Status.DELIVERED, delivered_at=timezone.now(),
                    next_attempt_at=None, last_error="")
        return WebhookEvent.Status.DELIVERED
    if outcome.permanent or attempt >= conf["WEBHOOK_MAX_ATTEMPTS"]:
        log.warning("webhook %s failed for good after %d attempt(s): %s", event_id, attempt,
                    outcome.error)
        mine.update(status=WebhookEvent.Status.FAILED, next_attempt_at=None,
                    last_error=outcome.error)
        return WebhookEvent.Status.FAILED
    mine.update(next_attempt_at=timezone.now() + retry_delay(attempt), last_error=outcome.error)
    return WebhookEvent.Status.PENDING


def retry_now(*, events: Any) -> int:
    """Make events due at once (the admin's action): failed ones get one more attempt."""
    return events.exclude(status=WebhookEvent.Status.DELIVERED).update(
        status=WebhookEvent.Status.PENDING, next_attempt_at=timezone.now())
