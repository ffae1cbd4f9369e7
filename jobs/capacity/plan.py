"""The capacity plan: how much work each running batch has left, when it is expected to end
on the workers alive now, which batches would miss their window unless their shards go
first, and how many workers of a model would finish everything inside its window (the
number an autoscaler scales on). docs/operations.md, "Capacity and deadlines".

Work is counted in engine seconds: the ledger's `engine_seconds` split a worker's busy time
among the requests in its engine, so a worker gives one engine second per second while
busy, whatever its batch size. A model's price of a prompt token and of an output token in
engine seconds (prefill and decode apart) is fitted on its recent ledger rows; before it
has any, from what its live workers report (jobs.capacity.fleet), else BATCHWEB_DEFAULT_WORKER_
TOKENS_PER_SECOND. A batch's work is what validation counted (its prompts' tokens and its
output limits), output scaled by the share of their limits the model's requests really
produced (the batch's own once it has answers), and its requests not yet answered.

Each batch has a target: its window's end less BATCHWEB_CAPACITY_MARGIN of the time left.
- **Order.** Within a priority, batches share the workers (their shards interleave in the
  queue) while that meets every target. When sharing would make one late (k batches
  sharing with it), the batches due no later than it run earliest deadline first: the
  first of them is *urgent*, its shards put at the front of its queue
  (jobs.services.scheduling) until it is not, then the next. One at a time: two urgent
  batches would take turns at the front, each new shard of one put before the other's.
  Every batch's slack shrinks while it waits, so none waits for ever.
  BATCHWEB_DEADLINE_ORDER=0 is a comparison switch, not a setting to run with: no batch is
  urgent, so batches share the workers as before deadlines (fair share within a
  priority) and are projected so; bench/simulation.py runs one day both ways.
- **Projection.** Priorities in the order workers take them; within one, the batches in
  deadline order one after another, then the rest sharing what is left (processor
  sharing). A running batch is projected at its own pace once it has answered some
  requests (`_own_pace`).
- **Waiting for a worker.** With no live worker of its model, nothing of a batch runs: it
  waits for the worker the capacity signal asks for (`workers_needed` is 1 at least), and
  is projected on that one worker after its cold start (the model's last one, reported by
  its worker; COLD_START_SECONDS before any), or, once a worker of the model is loading
  its engine, after what is left of it (`Startup`). Its row says which (`waits_for`), and
  as it waits its end moves on with the clock (Batch.projection, the rule every reader
  asks).
- **At risk**: projected past its target, on the workers alive now (one after its cold
  start, when none is): flagged on its page, list, API object and /metrics, and its
  owner's webhook gets one `batchweb.batch.at_risk` event.
- **Workers needed**: the fewest workers that meet every target, earliest deadline first:
  the largest, over the deadlines, of the work due by each over the time to it. It counts
  validated batches only: a batch still `validating` has no known work, and may yet fail
  without running anything. So a model's workers can be scaled to zero only beside
  something that validates without them, `manage.py controlworker` (no engine, no GPU):
  there a new batch becomes `in_progress` in seconds, and then asks for its first worker.
  Counting validating batches instead would start a GPU to check a file, and wait minutes
  of a model's cold start to reject a bad one.

Here, below the services and the read models, which both read it; the reconciler's pass
writes what it finds on the batches' rows (jobs.services.deadlines).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import redis
from django.conf import settings
from django.db.models import F, Min, Q, Sum
from django.utils import timezone

from jobs.capacity import fleet
from jobs.lib import queues
from jobs.models import WAITS_FOR_START, WAITS_FOR_WORKER, Batch, Shard, UsageRecord, target_seconds

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
# A model's cold start (seconds from a worker's start to its first shard) before any of its
# workers reported one: a CPU engine loads in 30 to 100 s (bench/RESULTS.md, "Cold
# start"), a GPU node that pulls its image and weights takes minutes.
COLD_START_SECONDS = 180.0


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
    return target_seconds(batch.expires_at, now)


@dataclass
class Planned:
    batch: Batch
    remaining: float  # engine seconds
    finish: datetime | None = None
    urgent: bool = False
    at_risk: bool = False
    slack: float = 0.0
    waits_for: str = ""  # what it waits for before it can run (Batch.projection)


@dataclass
class ModelPlan:
    model: str
    workers: list[fleet.WorkerRate]  # its live workers
    rates: Rates
    batches: list[Planned] = field(default_factory=list)
    # Without a live worker: how far the first one is from taking shards, which every
    # batch waits for first.
    startup: Startup | None = None

    @property
    def workers_needed(self) -> int:
        return workers_needed(self.batches, now=timezone.now())

    @property
    def at_risk(self) -> list[Planned]:
        return [p for p in self.batches if p.at_risk]


@dataclass(frozen=True)
class Startup:
    """How far the first worker of a model without any is from taking its shards."""

    cold_start: float  # seconds a worker's start takes (the model's last one)
    starting_for: float | None = None  # seconds since one began loading; None: none is

    @property
    def wait(self) -> float:
        if self.starting_for is None:
            return self.cold_start
        # One that takes longer than the last is expected any moment.
        return max(0.0, self.cold_start - self.starting_for)

    @property
    def waits_for(self) -> str:
        return WAITS_FOR_WORKER if self.starting_for is None else WAITS_FOR_START


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


def deadline_order() -> bool:
    """Whether urgent batches go first (BATCHWEB_DEADLINE_ORDER, the comparison switch:
    read at every plan, so a comparison flips it without restarting the workers)."""
    return os.environ.get("BATCHWEB_DEADLINE_ORDER", "1").strip() != "0"


def plan_model(model: str, batches: list[Batch], *, workers: list[fleet.WorkerRate],
               now: datetime, startup: Startup | None = None) -> ModelPlan:
    """The plan of `model`'s running batches on its live `workers`; with none, on the one
    the capacity signal asks for, once it started (`startup`; by default as Redis says,
    `model_startup`)."""
    rates = model_rates(model, workers=workers, now=now)
    ordered = deadline_order()
    capacity = float(max(len(workers), 1))
    result = ModelPlan(model=model, workers=workers, rates=rates,
                       batches=[Planned(b, remaining_seconds(b, rates)) for b in batches])
    # Seconds of capacity the higher priorities and the deadline order take; without a
    # worker, first the cold start of the one asked for.
    offset = 0.0
    if not workers:
        result.startup = startup or model_startup(model, now=now)
        offset = result.startup.wait
        for item in result.batches:
            item.waits_for = result.startup.waits_for
    for priority in queues.PRIORITIES:
        group = [p for p in result.batches if p.batch.priority == priority and p.remaining > 0]
        late = []
        for item in group:
            time_to = target(item.batch, now)
            item.slack = time_to - item.remaining / capacity
            if len(group) * item.remaining / capacity > time_to:
                late.append(item)
        # Earliest deadline first, up to the last batch that sharing would make late: a
        # batch due sooner than it goes before it too, or putting the late one first would
        # make that one late instead.
        horizon = max((target(p.batch, now) for p in late), default=-math.inf)
        first = sorted((p for p in group if target(p.batch, now) <= horizon),
                       key=lambda p: target(p.batch, now)) if ordered else []
        if first:
            # One batch at a time at the front of the queue: two would take turns there,
            # each new shard of one put before the other's.
            first[0].urgent = True
        for item in first:
            offset += item.remaining / capacity
            item.finish = now + timedelta(seconds=offset)
        ahead = {id(p) for p in first}
        offset = _share(sorted((p for p in group if id(p) not in ahead),
                               key=lambda p: p.remaining), capacity=capacity, offset=offset,
                        now=now)
    # Its own pace says how fast it runs, not when a worker comes back to it.
    started = _started([b.pk for b in batches]) if workers else {}
    for item in result.batches:
        own = _own_pace(item.batch, now, started=started.get(item.batch.pk)) if workers else None
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


def _started(batch_ids: list[str]) -> dict[str, tuple[datetime, int]]:
    """Per batch: when its first shard was claimed, and its requests claimed by a worker
    and not answered yet (in an engine, or about to be)."""
    if not batch_ids:
        return {}
    rows = Shard.objects.filter(batch_id__in=batch_ids, started_at__isnull=False).values(
        "batch_id").order_by().annotate(
        first=Min("started_at"),
        claimed=Sum(F("request_count") - F("completed") - F("failed"),
                    filter=Q(status=Shard.Status.RUNNING)))
    return {row["batch_id"]: (row["first"], max(0, row["claimed"] or 0)) for row in rows}


def _own_pace(batch: Batch, now: datetime, *,
              started: tuple[datetime, int] | None = None) -> datetime | None:
    """When the batch ends at its own pace, once that says enough: OWN_PACE_SHARE of its
    requests answered, and OWN_PACE_SECONDS since its first answers the plan saw
    (`Batch.pace_at`, written by the reconciler's pass).

    Two paces, weighed by the share of the batch answered:
    - its answers since `pace_at`. Early on this is the first wave of generations: an
      engine takes in as many requests as it holds at once and answers none until their
      prompts are computed and the first answers are written, so a young batch's answers
      run at a fraction of the engine's pace (a 2,000-request batch at 10% was projected
      70% late on it);
    - its requests *started*, answered or in flight (`started`: claimed by a worker, not
      answered), over the time since its first shard was claimed. An engine takes in a new
      request for each one it answers, so this counts the work under way, not only the
      work written: in a steady engine it is its pace exactly (Little's law: in flight =
      pace x time in the engine), from the first wave on. It runs high by what waits in a
      worker's intake, which matters less as the batch goes on.
    The answers' own pace takes over as the batch goes: by then it is measured over most of
    its run, and a fleet that changed size shows there first."""
    if batch.pace_at is None or batch.total <= 0:
        return None
    answered = batch.completed + batch.failed
    elapsed = (now - batch.pace_at).total_seconds()
    since = answered - batch.pace_answered
    if elapsed < OWN_PACE_SECONDS or since <= 0 or answered < OWN_PACE_SHARE * batch.total:
        return None
    pace = since / elapsed
    if started is not None:
        first, claimed = started
        running = (now - first).total_seconds()
        if running > 0:
            done = min(1.0, answered / batch.total)
            pace = (1 - done) * (answered + claimed) / running + done * pace
    left = max(0, batch.total - answered)
    return now + timedelta(seconds=left / pace)


def running_batches() -> dict[str, list[Batch]]:
    """The batches the plan covers, by model: in progress and not being stopped."""
    found: dict[str, list[Batch]] = {}
    for batch in Batch.objects.filter(status=Batch.Status.IN_PROGRESS, stop_code="").only(
            "id", "owner_id", "model", "priority", "total", "completed", "failed",
            "output_tokens", "work_input_tokens", "work_output_tokens", "expires_at",
            "created_at", "in_progress_at", "expected_completion_at", "at_risk", "urgent",
            "status", "pace_at", "pace_answered", "planned_at", "waits_for"):
        found.setdefault(batch.model, []).append(batch)
    return found


def model_startup(model: str, *, now: datetime) -> Startup:
    """How far a first worker of `model` is from taking shards: its last worker's cold
    start (COLD_START_SECONDS before any, or when Redis cannot say), and how long ago one
    began to load its engine, if one did within twice that (an older one died loading)."""
    try:
        connection = queues.connection()
        reported = fleet.cold_start_seconds(connection, model)
        cold_start = COLD_START_SECONDS if reported is None else reported
        since = fleet.starting_since(connection, model, max_age=2 * cold_start + float(
            settings.BATCHWEB["HEARTBEAT_TIMEOUT_SECONDS"]))
    except redis.RedisError:
        return Startup(COLD_START_SECONDS)
    return Startup(cold_start, None if since is None else max(0.0, now.timestamp() - since))


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


def remote_floor(plan: ModelPlan, *, token_seconds: float, now: datetime) -> float:
    """The requests in flight a remote model's batches need on its server to meet their
    windows (the deadline floor of engine/remote_slo.py). The plan's work due by each
    target over the time to it is engine seconds per second (workers_needed before
    rounding); one engine second of a remote worker is 1 / output_seconds output tokens,
    and a request in flight there yields 1 / token_seconds of them a second (Little's
    law), so it takes rate x token_seconds / output_seconds requests. 0 when nothing is
    due or no request's pace is known yet."""
    if token_seconds <= 0 or plan.rates.output_seconds <= 0:
        return 0.0
    due = sorted((p for p in plan.batches if p.remaining > 0),
                 key=lambda p: target(p.batch, now))
    rate, work = 0.0, 0.0
    for item in due:
        work += item.remaining
        seconds = target(item.batch, now)
        if seconds > 0:  # past its target already: no concurrency brings that back
            rate = max(rate, work / seconds)
    return rate * token_seconds / plan.rates.output_seconds
