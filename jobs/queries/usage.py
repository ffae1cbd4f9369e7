"""Reads of the usage ledger: a batch's cost, and usage summed by time bucket and by key,
model, batch, user or endpoint, for the Usage page, its CSV, the admin and the Usage and
Costs API.

Sums per day over whole UTC days read the daily sums (UsageDay: a few hundred rows a day)
instead of the ledger's rows (UsageRecord: one per finished shard); the part of a period
that is not whole days (an end_time of now, a start within a day), hourly and minutely
buckets, and filters the daily sums do not keep (a batch, the base model) read the rows,
through their (owner, recorded_at) and (recorded_at) indexes."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any

from django.db.models import Max, QuerySet, Sum
from django.db.models.functions import Trunc
from django.utils import timezone

from jobs.models import EvalRun, UsageDay, UsageRecord

SUMS = ("requests_succeeded", "requests_failed", "input_tokens", "cached_tokens",
        "output_tokens", "reasoning_tokens", "cost_nanos", "engine_seconds")
# What a usage sum may be grouped by, and the ledger's column for each.
GROUPS = {"model": "model", "api_key_id": "api_key_id", "batch": "batch_id",
          "user_id": "owner_id", "endpoint": "endpoint", "currency": "currency",
          "base_model": "base_model", "eval_run": "eval_run"}
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

    def _common(self, rows: QuerySet[Any]) -> QuerySet[Any]:
        if self.owner_id is not None:
            rows = rows.filter(owner_id=self.owner_id)
        if self.owner_ids:
            rows = rows.filter(owner_id__in=self.owner_ids)
        if self.models:
            rows = rows.filter(model__in=self.models)
        if self.api_key_ids:
            rows = rows.filter(api_key_id__in=self.api_key_ids)
        if self.endpoints is not None:
            rows = rows.filter(endpoint__in=list(self.endpoints))
        return rows

    def rows(self, start: datetime | None = None, end: datetime | None = None
             ) -> QuerySet[UsageRecord]:
        """The ledger's rows (within [start, end) as well, when given)."""
        rows = self._common(UsageRecord.objects.order_by())
        for bound, lookup in ((self.start, "gte"), (start, "gte"), (self.end, "lt"),
                              (end, "lt")):
            if bound is not None:
                rows = rows.filter(**{f"recorded_at__{lookup}": bound})
        if self.batches:
            rows = rows.filter(batch_id__in=self.batches)
        return rows

    def days(self, first: date, stop: date) -> QuerySet[UsageDay]:
        """The daily sums of the days [first, stop)."""
        return self._common(UsageDay.objects.order_by()).filter(day__gte=first, day__lt=stop)

    def whole_days(self) -> tuple[date, date] | None:
        """The whole UTC days of the period that the daily sums can answer, or None."""
        if self.batches or self.start is None:
            return None
        first = _day_at_or_after(self.start)
        stop = (self.end or timezone.now()).astimezone(UTC).date()
        return (first, stop) if first < stop else None


def _day_at_or_after(moment: datetime) -> date:
    moment = moment.astimezone(UTC)
    day = moment.date()
    return day if moment == datetime(day.year, day.month, day.day, tzinfo=UTC) \
        else day + timedelta(days=1)


def _midnight(day: date) -> datetime:
    return datetime(day.year, day.month, day.day, tzinfo=UTC)


def _day_columns(columns: list[str]) -> list[str] | None:
    day_fields = {"model", "api_key_id", "owner_id", "endpoint", "currency", "eval_run"}
    return columns if set(columns) <= day_fields else None


def _from_days(row: dict[str, Any]) -> dict[str, Any]:
    row["bucket"] = _midnight(row.pop("day"))
    if row.get("api_key_id") == 0:
        row["api_key_id"] = None  # the dashboard, as the ledger's NULL
    return row


def _sums() -> dict[str, Any]:
    return {name: Sum(name) for name in SUMS}


def totals(filters: Filters) -> dict[str, Any]:
    sums = {name: Sum(name) for name in SUMS}
    days = filters.whole_days()
    parts = [filters.rows().aggregate(**sums)] if days is None else [
        filters.days(*days).aggregate(**sums),
        filters.rows(end=_midnight(days[0])).aggregate(**sums),
        filters.rows(start=_midnight(days[1])).aggregate(**sums)]
    return {name: sum(part[name] or 0 for part in parts) for name in SUMS}


def bucketed(filters: Filters, *, bucket_width: str = "1d",
             group_by: list[str] | None = None) -> list[dict[str, Any]]:
    """Sums per time bucket (UTC) and per group: one dict per (bucket, group values) that
    has rows, ordered by bucket, with `bucket` the bucket's start."""
    columns = [GROUPS[name] for name in group_by or []]
    days = filters.whole_days() if bucket_width == "1d" and _day_columns(columns) else None

    def from_rows(start: datetime | None = None, end: datetime | None = None
                  ) -> list[dict[str, Any]]:
        return list(filters.rows(start, end).annotate(
            bucket=Trunc("recorded_at", BUCKETS[bucket_width], tzinfo=UTC))
            .values("bucket", *columns).annotate(**_sums()))

    if days is None:
        rows = from_rows()
    else:
        daily = (filters.days(*days).values("day", *columns)
                 .annotate(**{name: Sum(name) for name in SUMS}))
        rows = [*from_rows(end=_midnight(days[0])), *map(_from_days, daily),
                *from_rows(start=_midnight(days[1]))]
    return sorted(rows, key=lambda r: (r["bucket"], *(str(r[c]) for c in columns)))


def batch_cost(batch_id: str) -> dict[str, Any]:
    """What the ledger charged a batch so far (the eval set its owner attached included,
    whose requests run as a batch of their own): cost, currency, tokens, engine seconds."""
    runs = EvalRun.objects.filter(batch_id=batch_id, trigger=EvalRun.Trigger.BATCH,
                                  run_batch__isnull=False).values_list("run_batch_id",
                                                                       flat=True)
    row = UsageRecord.objects.filter(batch_id__in=[batch_id, *runs]).order_by().aggregate(
        **_sums(), currency=Max("currency"))
    return {**{k: (row[k] or 0) for k in SUMS}, "currency": row["currency"] or ""}


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
