"""A running batch's projected end as it is read: what the capacity plan (jobs.capacity) last
wrote on its row, brought up to the moment of reading. The one rule that both API faces'
batch objects, the batch page and list, and queue health ask. docs/operations.md,
"Capacity and deadlines".

On the reconciler's pass the plan writes on the row when it expects the batch to end
(`expected_completion_at`), when it planned that (`planned_at`), whether that is past the
batch's target (`at_risk`), and what the batch waits for (`waits_for`), "" once a worker
runs its model:
- WORKER: no live worker serves its model. The capacity signal
  (`batchweb_workers_needed`, 1 at least while anything of the model waits) asks for one;
  the end counts that worker's cold start, then the batch's work on it.
- START: none serves it yet, but one is loading its engine: the end counts what is left
  of its cold start.
Nothing of a waiting batch runs, so the time since the plan adds to its end: read later
(the next pass has not come, or no process runs the reconciler any more), the end has moved
on by as long, and once it passes the batch's target the batch is at risk. A batch that
runs is projected where the plan put it, but never before the moment of reading: one the
plan expected to have ended by now is due now, until the next pass says when.

Here, below the models and the plan, which both use it (a batch's target included).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings

# What a waiting batch waits for (Batch.waits_for), in words for its pages: at length, the
# few words after its ETA, and its label in a list.
WORKER = "worker"
START = "start"
WAITS = {WORKER: "counting the start of a worker, which is asked for (none of its model "
                 "runs now)",
         START: "counting what is left of the start of a worker of its model, loading now"}
CONDITIONS = {WORKER: "if a worker starts now", START: "as a worker starts"}
LABELS = {WORKER: "waits for a worker", START: "a worker is starting"}


def target_seconds(expires_at: datetime | None, now: datetime) -> float:
    """Seconds from now to a batch's target: its window's end less BATCHWEB_CAPACITY_MARGIN
    of the time left (infinite without a window)."""
    if expires_at is None:
        return math.inf
    left = (expires_at - now).total_seconds()
    return left * (1 - float(settings.BATCHWEB["CAPACITY_MARGIN"]))


@dataclass(frozen=True)
class Projection:
    """When a batch is expected to end (None: it ended, is not running, or has no plan
    yet), what it waits for ("" once it runs) and whether the end is past its target."""

    end: datetime | None = None
    waits_for: str = ""
    at_risk: bool = False
    # How long this reading stays true (seconds): an answer showing it may be replayed
    # (batchweb.polls) that long, and no longer.
    fresh_for: float = math.inf

    def seconds_left(self, now: datetime) -> float | None:
        return None if self.end is None else max(0.0, (self.end - now).total_seconds())

    @property
    def epoch(self) -> int | None:
        """The end in whole seconds, rounded up: never a second before it."""
        return None if self.end is None else math.ceil(self.end.timestamp())

    def fields(self) -> dict[str, object]:
        """As both API faces' batch objects show it."""
        return {"expected_completion_at": self.epoch, "waits_for": self.waits_for or None,
                "at_risk": self.at_risk}

    @property
    def waiting(self) -> str:
        """What it waits for, in words ("" when it runs)."""
        return WAITS.get(self.waits_for, self.waits_for)

    @property
    def condition(self) -> str:
        """What its ETA counts on, in a few words ("" when it runs)."""
        return CONDITIONS.get(self.waits_for, "")

    @property
    def label(self) -> str:
        return LABELS.get(self.waits_for, self.waits_for)


def read(*, running: bool, end: datetime | None, planned_at: datetime | None,
         waits_for: str, at_risk: bool, expires_at: datetime | None,
         now: datetime) -> Projection:
    """The projection of a batch whose row says this, read at `now` (`running`: in
    progress and not being stopped)."""
    if not running or end is None:
        return Projection()
    target = now + timedelta(seconds=target_seconds(expires_at, now)) if expires_at else None
    if waits_for:
        waited = max(timedelta(0), now - (planned_at or now))
        end = end + waited
        # Its end moves on with the clock: an answer showing it stays true until that end
        # comes, or, while not at risk, until it passes the target.
        fresh = (end - now).total_seconds()
        if target is not None and not at_risk and end <= target:
            fresh = min(fresh, (target - end).total_seconds())
    else:
        fresh = (end - now).total_seconds()
    end = max(end, now)
    at_risk = at_risk or (target is not None and end > target)
    return Projection(end=end, waits_for=waits_for, at_risk=at_risk,
                      fresh_for=max(0.0, fresh))
