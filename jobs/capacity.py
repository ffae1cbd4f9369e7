"""The capacity plan: how much work each running batch has left, when it is expected to end
on the workers alive now, which batches would miss their window unless their shards go
first, and how many workers of a model would finish everything inside its window (the
number an autoscaler scales on). docs/operations.md, "Capacity and deadlines".

Work is counted in engine seconds: the ledger's `engine_seconds` split a worker's busy time
among the requests in its engine, so a worker gives one engine second per second while
busy, whatever its batch size. A model's price of a prompt token and of an output token in
engine seconds (prefill and decode apart) is fitted on its recent ledger rows; before it
has any, from what its live workers report (jobs.fleet), else BATCHWEB_DEFAULT_WORKER_
TOKENS_PER_SECOND. A batch's work is what validation counted (its prompts' tokens and its
output limits), output scaled by the share of their limits the model's requests really
produced (the batch's own once it has answers), and its requests not yet answered.

Each batch has a target: its window's end less BATCHWEB_CAPACITY_MARGIN of the time left.
- **Order.** Within a priority, batches share the workers (their shards interleave in the
  queue); a batch that would miss its target so, k batches sharing with it, is *urgent*:
  its shards are put at the front of its queue (jobs.services.scheduling) until it is not.
  Every batch's slack shrinks while it waits, so none waits for ever.
- **Projection.** Priorities in the order workers take them; within one, urgent batches one
  after another, least slack first, then the rest sharing what is left (processor
  sharing). A running batch is projected at its own pace since its first answers, once
  it has answered some requests.
- **At risk**: projected past its target, on the workers alive now (one, when none is):
  flagged on its page, list, API object and /metrics, and its owner's webhook gets one
  `batchweb.batch.at_risk` event.
- **Workers needed**: the fewest workers that meet every target, earliest deadline first:
  the largest, over the deadlines, of the work due by each over the time to it.

Here, below the services and the read models, which both read it; the reconciler's pass
writes what it finds on the batches' rows (jobs.services.deadlines).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import redis
from django.conf import settings
from django.db.models import Sum
from django.utils import timezone

from jobs import fleet, queues
from jobs.models import Batch, UsageRecord

# The ledger rows a model's rates are fitted on: its newest within HISTORY.
HISTORY = timedelta(hours=24)
HISTORY_ROWS = 500
# A prompt token's engine time against an output token's, where the ledger cannot tell
# them apart (every row of the same shape): prefill runs a prompt's tokens together.
PROMPT_TO_OUTPUT = 0.1
# A running batch is projected at its own pace once it has answered this share of its
# requests, over at least this long since its first answers.
OWN_PACE_SHARE = 0.02
OWN_PACE_SECONDS = 10.0
PRIORITY_ORDER = {name: i for i, name in enumerate(queues.PRIORITIES)}


@dataclass(frozen=True)
class Rates:
    """A model's engine seconds per prompt token and per output token, and the share of
    their output limits its requests produce."""

    prompt_seconds: float
    output_seconds: float
    output_share: float = 1.0
    source: str = "default"  # "ledger", "workers" or "default"


def model_rates(model: str, *, workers: Iterable[fleet.WorkerRate] = (),
                now: datetime | None = None) -> Rates:
    now = now or timezone.now()
    share = _output_share(model, now)
    rows = list(UsageRecord.objects.filter(
        base_model=model, recorded_at__gte=now - HISTORY, engine_seconds__gt=0,
        requests_succeeded__gt=0).order_by("-recorded_at").values_list(
        "input_tokens", "output_tokens", "engine_seconds")[:HISTORY_ROWS])
    fitted = _fit(rows)
    if fitted is not None:
        return Rates(*fitted, output_share=share, source="ledger")
    measured = [w for w in workers if w.output_tokens_per_second > 0]
    if measured:
        # In a busy second a worker did P prompt and O output tokens: 1 = a P + b O.
        per_second = sorted(w.output_tokens_per_second + PROMPT_TO_OUTPUT
                            * w.prompt_tokens_per_second for w in measured)
        output = 1.0 / per_second[len(per_second) // 2]
        return Rates(PROMPT_TO_OUTPUT * output, output, output_share=share, source="workers")
    output = 1.0 / float(settings.BATCHWEB["DEFAULT_WORKER_TOKENS_PER_SECOND"])
    return Rates(PROMPT_TO_OUTPUT * output, output, output_share=share)


def _fit(rows: list[tuple[int, int, float]]) -> tuple[float, float] | None:
    """(seconds per prompt token, per output token) by least squares on the rows; where
    the rows cannot tell the two apart, one price with a prompt token at PROMPT_TO_OUTPUT
    of an output token. None without rows."""
    if not rows:
        return None
    sxx = sum(x * x for x, _, _ in rows)
    syy = sum(y * y for _, y, _ in rows)
    sxy = sum(x * y for x, y, _ in rows)
    sxe = sum(x * e for x, _, e in rows)
    sye = sum(y * e for _, y, e in rows)
    det = sxx * syy - sxy * sxy
    if det > 1e-9 * sxx * syy:
        prompt = (sxe * syy - sye * sxy) / det
        output = (sye * sxx - sxe * sxy) / det
        if prompt >= 0 and output > 0:
            return prompt, output
    weight = sum(y + PROMPT_TO_OUTPUT * x for x, y, _ in rows)
    if weight <= 0:
        return None
    output = sum(e for _, _, e in rows) / weight
    return PROMPT_TO_OUTPUT * output, output


def _output_share(model: str, now: datetime) -> float:
    """The share of their output limits the model's recent batches produced (1 without
    any: a new model's requests are assumed to use all of theirs)."""
    sums = Batch.objects.filter(model=model, status=Batch.Status.COMPLETED,
                                completed_at__gte=now - HISTORY,
                                work_output_tokens__gt=0).aggregate(
        output=Sum("output_tokens"), limits=Sum("work_output_tokens"))
    if not sums["limits"]:
        return 1.0
    return min(1.0, max(0.01, (sums["output"] or 0) / sums["limits"]))


def remaining_seconds(batch: Batch, rates: Rates) -> float:
    """The engine seconds of the batch's requests not answered yet."""
    total = max(batch.total, 1)
    answered = min(total, batch.completed + batch.failed)
    share = rates.output_share
    if batch.completed and batch.work_output_tokens:
        # Its own answers so far: the best guess of the rest of them.
        share = min(1.0, max(0.01, batch.output_tokens * total
                             / (batch.work_output_tokens * batch.completed)))
    work = (batch.work_input_tokens * rates.prompt_seconds
            + batch.work_output_tokens * share * rates.output_seconds)
    return work * (total - answered) / total


def target(batch: Batch, now: datetime) -> float:
    """Seconds from now to the batch's target: its window's end less the margin."""
    if batch.expires_at is None:
        return math.inf
    left = (batch.expires_at - now).total_seconds()
    return left * (1 - float(settings.BATCHWEB["CAPACITY_MARGIN"]))


@dataclass
class Planned:
    batch: Batch
    remaining: float  # engine seconds
    finish: datetime | None = None
    urgent: bool = False
    at_risk: bool = False
    slack: float = 0.0


@dataclass
class ModelPlan:
    model: str
    workers: list[fleet.WorkerRate]  # its live workers
    rates: Rates
    batches: list[Planned] = field(default_factory=list)

    @property
    def workers_needed(self) -> int:
        return workers_needed(self.batches, now=timezone.now())


def workers_needed(planned: Iterable[Planned], *, now: datetime) -> int:
    """The fewest workers that finish every batch by its target, earliest deadline first:
    the largest, over the targets, of the work due by one over the time to it; 0 when
    nothing is left to run."""
    due = sorted((p for p in planned if p.remaining > 0), key=lambda p: target(p.batch, now))
    needed, work = 0, 0.0
    for item in due:
        work += item.remaining
        seconds = target(item.batch, now)
        if seconds <= 0:
            continue  # past its target already: no number of workers brings that back
        needed = max(needed, math.ceil(work / seconds - 1e-9))
    return max(needed, 1) if due else 0


def plan_model(model: str, batches: list[Batch], *, workers: list[fleet.WorkerRate],
               now: datetime) -> ModelPlan:
    rates = model_rates(model, workers=workers, now=now)
    capacity = float(max(len(workers), 1))
    result = ModelPlan(model=model, workers=workers, rates=rates,
                       batches=[Planned(b, remaining_seconds(b, rates)) for b in batches])
    offset = 0.0  # seconds of capacity the higher priorities and urgent batches take
    for priority in queues.PRIORITIES:
        group = [p for p in result.batches if p.batch.priority == priority and p.remaining > 0]
        for item in group:
            time_to = target(item.batch, now)
            item.slack = time_to - item.remaining / capacity
            item.urgent = len(group) * item.remaining / capacity > time_to
        for item in sorted((p for p in group if p.urgent), key=lambda p: p.slack):
            offset += item.remaining / capacity
            item.finish = now + timedelta(seconds=offset)
        offset = _share(sorted((p for p in group if not p.urgent), key=lambda p: p.remaining),
                        capacity=capacity, offset=offset, now=now)
    for item in result.batches:
        own = _own_pace(item.batch, now)
        if own is not None:
            item.finish = own
        item.at_risk = item.remaining > 0 and item.finish is not None and (
            (item.finish - now).total_seconds() > target(item.batch, now))
    return result


def _share(group: list[Planned], *, capacity: float, offset: float, now: datetime) -> float:
    """Processor sharing of `capacity` among `group` (least remaining first) after
    `offset` seconds: each one's finish; returns the offset after the last."""
    done_work, count = 0.0, len(group)
    for index, item in enumerate(group):
        # Until it ends, every one left gets capacity / (its count) each second.
        offset += (item.remaining - done_work) * (count - index) / capacity
        done_work = item.remaining
        item.finish = now + timedelta(seconds=offset)
    return offset


def _own_pace(batch: Batch, now: datetime) -> datetime | None:
    """When the batch ends at the pace it has answered its requests since its first answers
    (`Batch.pace_at`, written by the reconciler's pass: counted from its start, the pace
    would include the wait of the first answers for a whole generation, and project a
    young batch several times too late), once that says enough: OWN_PACE_SHARE of its
    requests answered, and OWN_PACE_SECONDS since."""
    if batch.pace_at is None or batch.total <= 0:
        return None
    answered = batch.completed + batch.failed
    elapsed = (now - batch.pace_at).total_seconds()
    since = answered - batch.pace_answered
    if elapsed < OWN_PACE_SECONDS or since <= 0 or answered < OWN_PACE_SHARE * batch.total:
        return None
    left = max(0, batch.total - answered)
    return now + timedelta(seconds=left * elapsed / since)


def running_batches() -> dict[str, list[Batch]]:
    """The batches the plan covers, by model: in progress and not being stopped."""
    found: dict[str, list[Batch]] = {}
    for batch in Batch.objects.filter(status=Batch.Status.IN_PROGRESS, stop_code="").only(
            "id", "owner_id", "model", "priority", "total", "completed", "failed",
            "output_tokens", "work_input_tokens", "work_output_tokens", "expires_at",
            "created_at", "in_progress_at", "expected_completion_at", "at_risk", "urgent",
            "status", "pace_at", "pace_answered"):
        found.setdefault(batch.model, []).append(batch)
    return found


def live_workers(model: str) -> list[fleet.WorkerRate]:
    """The model's workers that reported within the heartbeat timeout; none when Redis
    cannot say."""
    try:
        return fleet.worker_rates(queues.connection(), model,
                                  max_age=settings.BATCHWEB["HEARTBEAT_TIMEOUT_SECONDS"])
    except redis.RedisError:
        return []


def plans(*, now: datetime | None = None) -> list[ModelPlan]:
    """The plan of every model with batches running."""
    now = now or timezone.now()
    return [plan_model(model, batches, workers=live_workers(model), now=now)
            for model, batches in sorted(running_batches().items())]
