"""Spot checks: a person's good/bad verdict on a request of a batch's spot-check sample
(the sample itself, and the share marked good, are read by jobs.queries.spot_samples)."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from jobs.lib.errors import ServiceError
from jobs.models import Batch, SpotCheck


def mark(*, batch: Batch, custom_id: str, verdict: str, note: str, user: Any,
         sampled: Collection[str]) -> SpotCheck:
    """Record (or replace) the verdict on one sampled request. Only requests of the
    batch's current sample can be marked: `sampled` holds their custom_ids (the sample
    shown, jobs.queries.spot_samples.sample)."""
    if verdict not in SpotCheck.Verdict.values:
        raise ServiceError("verdict must be good or bad.", param="verdict")
    if custom_id not in sampled:
        raise ServiceError("That request is not in this batch's spot-check sample.",
                           param="custom_id")
    spot, _ = SpotCheck.objects.update_or_create(
        batch=batch, custom_id=custom_id,
        defaults={"verdict": verdict, "note": note[:2000], "marked_by": user})
    return spot
