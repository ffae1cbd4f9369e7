"""Spot-check marks: a person's good/bad verdict on sampled results, and the share good."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.db.models import Count, Q

from jobs.models import Batch, SpotCheck
from jobs.services.errors import ServiceError
from jobs.services.results import flagged_sample, spot_sample


@dataclass
class SpotSummary:
    marked: int
    good: int

    @property
    def share_good(self) -> float | None:
        return self.good / self.marked if self.marked else None


def summary(batch: Batch) -> SpotSummary:
    agg = SpotCheck.objects.filter(batch=batch).aggregate(
        marked=Count("pk"), good=Count("pk", filter=Q(verdict=SpotCheck.Verdict.GOOD)))
    return SpotSummary(marked=agg["marked"], good=agg["good"])


def marks(batch: Batch) -> dict[str, SpotCheck]:
    return {m.custom_id: m for m in SpotCheck.objects.filter(batch=batch)}


def sample(batch: Batch, *, flagged: bool = False) -> list[Any]:
    """The spot-check sample: of all finished requests, or of the flagged ones only."""
    return flagged_sample(batch) if flagged else spot_sample(batch)


def mark(*, batch: Batch, custom_id: str, verdict: str, note: str, user: Any,
         flagged: bool = False) -> SpotCheck:
    """Record (or replace) the verdict on one sampled request. Only requests of the
    batch's current sample (the flagged-only one with `flagged`) can be marked."""
    if verdict not in SpotCheck.Verdict.values:
        raise ServiceError("verdict must be good or bad.", param="verdict")
    if custom_id not in {item.custom_id for item in sample(batch, flagged=flagged)}:
        raise ServiceError("That request is not in this batch's spot-check sample.",
                           param="custom_id")
    spot, _ = SpotCheck.objects.update_or_create(
        batch=batch, custom_id=custom_id,
        defaults={"verdict": verdict, "note": note[:2000], "marked_by": user})
    return spot
