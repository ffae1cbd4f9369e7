"""Reads of the usage ledger (UsageRecord): a batch's cost, and usage summed by time bucket
and by key, model, batch, user or endpoint, for the Usage page, its CSV, the admin and the
Usage and Costs API. Every sum is one GROUP BY over the ledger's (owner, recorded_at) or
(recorded_at) index."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from django.db.models import Count, F, QuerySet, Sum
from django.db.models.functions import Trunc
from django.utils import timezone

from jobs.models import UsageRecord

SUMS = ("requests_succeeded", "requests_failed", "input_tokens", "cached_tokens",
        "output_tokens", "cost_nanos", "engine_seconds")
# What a usage sum may be grouped by, and the ledger's column for each.
GROUPS = {"model": "model", "api_key_id": "api_key_id", "batch": "batch_id",
          "user_id": "owner_id", "endpoint": "endpoint", "currency": "currency",
          "base_model": "base_model"}
BUCKETS = {"1m": "minute", "1h": "hour", "1d": "day"}
BUCKET_SECONDS = {"1m": 60, "1h": 3600, "1d": 86400}


@dataclass
class Filters:
    """Which ledger rows: an owner (None: everyone's, for staff), a period [start, end),
    and optional lists of models, API key ids and batch ids; endpoints limits the kind
    (completions or embeddings)."""

    owner_id: int | None = None
    owner_ids: list[int] | None = None
    start: datetime | None = None
    end: datetime | None = None
    models: list[str] | None = None
    api_key_ids: list[int] | None = None
    batches: list[str] | None = None
    endpoints: Iterable[str] | None = None

    def rows(self) -> QuerySet[UsageRecord]:
        rows = UsageRecord.objects.order_by()
        if self.owner_id is not None:
            rows = rows.filter(owner_id=self.owner_id)
        if self.owner_ids:
            rows = rows.filter(owner_id__in=self.owner_ids)
        if self.start is not None:
            rows = rows.filter(recorded_at__gte=self.start)
        if self.end is not None:
            rows = rows.filter(recorded_at__lt=self.end)
        if self.models:
            rows = rows.filter(model__in=self.models)
        if self.api_key_ids:
            rows = rows.filter(api_key_id__in=self.api_key_ids)
        if self.batches:
            rows = rows.filter(batch_id__in=self.batches)
        if self.endpoints is not None:
            rows = rows.filter(endpoint__in=list(self.endpoints))
        return rows


def _sums() -> dict[str, Any]:
    return {name: Sum(name) for name in SUMS} | {"records": Count("id")}


def totals(filters: Filters) -> dict[str, Any]:
    row = filters.rows().aggregate(**_sums())
    return {k: (v or 0) for k, v in row.items()}


def bucketed(filters: Filters, *, bucket_width: str = "1d",
             group_by: list[str] | None = None) -> list[dict[str, Any]]:
    """Sums per time bucket (UTC) and per group: one dict per (bucket, group values) that
    has rows, ordered by bucket, with `bucket` the bucket's start."""
    columns = [GROUPS[name] for name in group_by or []]
    rows = (filters.rows().annotate(bucket=Trunc("recorded_at", BUCKETS[bucket_width],
                                                 tzinfo=UTC))
            .values("bucket", *columns).annotate(**_sums()).order_by("bucket", *columns))
    return list(rows)


def grouped(filters: Filters, *, group_by: list[str]) -> list[dict[str, Any]]:
    """Sums per group over the whole period, biggest cost first."""
    columns = [GROUPS[name] for name in group_by]
    return list(filters.rows().values(*columns).annotate(**_sums())
                .order_by(F("cost_nanos").desc(nulls_last=True), *columns))


def batch_cost(batch_id: str) -> dict[str, Any]:
    """What the ledger charged a batch so far: cost, currency, tokens, engine seconds."""
    row = UsageRecord.objects.filter(batch_id=batch_id).order_by().aggregate(
        **_sums(), currencies=Count("currency", distinct=True))
    currency = (UsageRecord.objects.filter(batch_id=batch_id).values_list("currency", flat=True)
                .first()) or ""
    return {**{k: (v or 0) for k, v in row.items()}, "currency": currency}


def day_range(days: int, *, now: datetime | None = None) -> tuple[datetime, datetime]:
    """[start of the day `days - 1` days ago, end of today) in UTC: the last `days` days."""
    now = now or timezone.now()
    end = now.astimezone(UTC).replace(hour=0, minute=0, second=0,
                                               microsecond=0) + timedelta(days=1)
    return end - timedelta(days=days), end


CSV_COLUMNS = ("requests_succeeded", "requests_failed", "input_tokens", "cached_tokens",
               "output_tokens", "cost", "currency", "engine_seconds")


def csv_lines(rows: Iterable[dict[str, Any]], keys: list[str]) -> Iterable[str]:
    """Usage sums as CSV lines: `keys` (bucket, model...) then CSV_COLUMNS, cost in the
    currency's units (the ledger keeps billionths)."""
    import csv
    import io

    buffer = io.StringIO()
    writer = csv.writer(buffer)

    def line(values: list[Any]) -> str:
        buffer.seek(0)
        buffer.truncate()
        writer.writerow(values)
        return buffer.getvalue()

    yield line([*keys, *CSV_COLUMNS])
    for row in rows:
        values = [row[k].isoformat() if isinstance(row[k], datetime) else row[k] for k in keys]
        cost = Decimal(row["cost_nanos"] or 0) / 10**9
        yield line([*values, *(row[k] or 0 for k in CSV_COLUMNS[:5]), f"{cost:f}",
                    row.get("currency", ""), round(float(row["engine_seconds"] or 0), 3)])
