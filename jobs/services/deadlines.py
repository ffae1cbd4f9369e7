"""The capacity plan's writes (the plan itself is jobs.capacity.plan): on the reconciler's pass,
each running batch's expected end (with when it was planned and what the batch waits for,
which Batch.projection reads it by), whether it is at risk and whether its shards go first
in line are written on its row; a batch whose shards become urgent has those already
waiting moved to the front of its queue, and a batch newly at risk gets its owner's
webhook event, once. docs/operations.md, "Capacity and deadlines"."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

import redis
from django.db.models import F
from django.utils import timezone

from engine.remote_limits import set_floor, token_seconds
from jobs.capacity.plan import ModelPlan, Planned, plans, remote_floor
from jobs.lib import queues
from jobs.lib.model_registry import model_specs
from jobs.models import Batch, Shard

log = logging.getLogger(__name__)

AT_RISK_EVENT = "batchweb.batch.at_risk"


def refresh(*, now: datetime | None = None) -> int:
    """Write what the plan says on the running batches' rows (expected end, at risk,
    urgent) and send each batch newly at risk its owner's webhook event. Returns how many
    rows changed."""
    from jobs.services.webhooks import batch_event

    now = now or timezone.now()
    changed = 0
    model_plans = plans(now=now)
    publish_remote_floors(model_plans, now=now)
    for model_plan in model_plans:
        for item in model_plan.batches:
            batch = item.batch
            finish = item.finish.replace(microsecond=0) if item.finish else None
            answered = batch.completed + batch.failed
            if batch.pace_at is None and answered:
                # Its pace is counted from here (jobs.capacity.plan._own_pace).
                Batch.objects.filter(pk=batch.pk, pace_at__isnull=True).update(
                    pace_at=now, pace_answered=answered)
            if (finish, item.at_risk, item.urgent, item.waits_for) == (
                    batch.expected_completion_at, batch.at_risk, batch.urgent,
                    batch.waits_for) or _waits_as_long(item, finish, now):
                continue
            # A new version: open pages and polls show it (jobs.services.progress).
            changed += Batch.objects.filter(pk=batch.pk, status=Batch.Status.IN_PROGRESS
                                            ).update(expected_completion_at=finish,
                                                     planned_at=now, waits_for=item.waits_for,
                                                     at_risk=item.at_risk, urgent=item.urgent,
                                                     progress_version=F("progress_version")
                                                     + 1)
            if item.urgent and not batch.urgent:
                # Its shards already waiting in the queue go first as well.
                for shard_id, queue_name in Shard.objects.filter(
                        batch_id=batch.pk, status=Shard.Status.QUEUED,
                        enqueued_at__isnull=False).values_list("pk", "queue_name"):
                    queues.move_to_front(shard_id, queue_name)
            if item.at_risk and not batch.at_risk:
                log.info("batch %s at risk: expected %s, its window ends %s", batch.pk,
                         finish, batch.expires_at)
                batch_event(batch_id=batch.pk, type=AT_RISK_EVENT)
    return changed


def _waits_as_long(item: Planned, finish: datetime | None, now: datetime) -> bool:
    """Whether a waiting batch still waits as the row says, as long: its end moves on with
    the clock as it is read (Batch.projection), so its row, and every poll's answer, stays
    as it was rather than becoming a new version on every pass."""
    batch = item.batch
    if not (item.waits_for and finish and batch.expected_completion_at and batch.planned_at
            and (item.waits_for, item.at_risk, item.urgent)
            == (batch.waits_for, batch.at_risk, batch.urgent)):
        return False
    # Both ends are whole seconds, their plans' moments are not.
    return abs((finish - now) - (batch.expected_completion_at - batch.planned_at)) < timedelta(
        seconds=2)


def publish_remote_floors(model_plans: list[ModelPlan], *, now: datetime) -> None:
    """Each remote server's deadline floor, summed over the models on it (0 with nothing
    due): the SLO steering its limit stays above it (engine/remote_slo.py)."""
    planned = {p.model: p for p in model_plans}
    connection = queues.connection()
    floors: dict[str, float] = {}
    try:
        for spec in model_specs():
            if spec.backend != "remote":
                continue
            url = str(spec.options["base_url"]).rstrip("/")
            plan = planned.get(spec.name)
            floors[url] = floors.get(url, 0.0) + (remote_floor(
                plan, token_seconds=token_seconds(connection, url), now=now) if plan else 0.0)
        for url, floor in floors.items():
            set_floor(connection, url, floor)
    except redis.RedisError as e:  # the rows above still get written; floors lapse
        log.warning("remote deadline floors not written (%s)", e)
