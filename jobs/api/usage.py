"""OpenAI's Usage and Costs API over the usage ledger: GET /v1/organization/usage/completions,
/v1/organization/usage/embeddings, /v1/organization/usage/moderations and
/v1/organization/costs, in OpenAI's shapes, so usage tooling written for it reads
batchweb's.

A key sees its owner's usage; the key of a superuser, or of a user given the permission to
view usage records (`jobs.view_usagerecord`), sees everyone's (and may filter by
`user_ids`): OpenAI answers these endpoints to admin keys only, and being staff alone (an
admin login) is not that. What differs from OpenAI: there are no projects (`project_id` is
always null, `project_ids` matches nothing but null), every request is a batch request
(`batch=false` matches nothing), ids are batchweb's (`api_key_id` and `user_id` are the
key's and the user's numeric ids as strings), and a costs `line_item` is the model's name.
Embeddings usage counts /v1/embeddings, /v1/score and /v1/rerank (input tokens only),
moderations usage /v1/moderations (as OpenAI's, a kind of its own: input tokens, the
prompt tokens of its embeddings call), completions the other endpoints. Usage is recorded
when each shard of a batch finishes (`recorded_at`). One extension: a completions result's
`output_reasoning_tokens`, the reasoning tokens of its output tokens (OpenAI's results have
no such field; clients ignore it).
"""

from __future__ import annotations

import base64
from datetime import UTC, datetime, timedelta
from typing import Any

from django.http import HttpRequest, JsonResponse
from django.utils import timezone

from engine.endpoints import ENDPOINTS, MODERATIONS, POOLING_ENDPOINTS
from jobs.api.base import api_view
from jobs.lib.errors import ServiceError
from jobs.queries import usage

# Per bucket width: (default, maximum) buckets a page, as OpenAI's.
LIMITS = {"1m": (60, 1440), "1h": (24, 168), "1d": (7, 31)}
COSTS_LIMITS = (7, 180)
# The endpoints each usage kind counts.
KINDS = {"completions": tuple(e for e in ENDPOINTS if e not in POOLING_ENDPOINTS),
         "embeddings": tuple(e for e in POOLING_ENDPOINTS if e != MODERATIONS),
         "moderations": (MODERATIONS,)}


def _list(request: HttpRequest, name: str) -> list[str]:
    # `models=a&models=b`, `models[]=a`, or `models=a,b`.
    values = request.GET.getlist(name) + request.GET.getlist(f"{name}[]")
    return [item for value in values for item in value.split(",") if item]


def _time(request: HttpRequest, name: str, *, required: bool) -> datetime | None:
    value = request.GET.get(name)
    if value in (None, ""):
        if required:
            raise ServiceError(f"{name} is required (Unix seconds).", param=name)
        return None
    try:
        return datetime.fromtimestamp(int(value), tz=UTC)
    except (ValueError, OverflowError, OSError):
        raise ServiceError(f"{name} must be Unix seconds.", param=name) from None


def _int_ids(values: list[str], name: str) -> list[int]:
    try:
        return [int(value) for value in values]
    except ValueError:
        raise ServiceError(f"{name} must be ids as this API shows them.", param=name) from None


class Query:
    """The parameters every one of these endpoints takes, checked."""

    def __init__(self, request: HttpRequest, user: Any, *, widths: tuple[str, ...],
                 groups: tuple[str, ...], limits: tuple[int, int]) -> None:
        self.bucket_width = request.GET.get("bucket_width") or "1d"
        if self.bucket_width not in widths:
            raise ServiceError(f"bucket_width must be one of {', '.join(widths)}.",
                               param="bucket_width")
        self.step = timedelta(seconds=usage.BUCKET_SECONDS[self.bucket_width])
        start = _time(request, "start_time", required=True)
        end = _time(request, "end_time", required=False) or timezone.now()
        assert start is not None
        self.group_by = _list(request, "group_by")
        for name in self.group_by:
            if name not in groups:
                raise ServiceError(f"group_by takes {', '.join(groups)}.", param="group_by")
        default, maximum = limits
        limit = request.GET.get("limit")
        try:
            self.limit = int(limit) if limit not in (None, "") else default
        except ValueError:
            raise ServiceError("limit must be an integer.", param="limit") from None
        if not 1 <= self.limit <= maximum:
            raise ServiceError(f"limit must be between 1 and {maximum}.", param="limit")
        page = request.GET.get("page")
        if page:
            try:
                start = datetime.fromtimestamp(int(base64.urlsafe_b64decode(page)), tz=UTC)
            except (ValueError, OverflowError, OSError):
                raise ServiceError("page must be a next_page of this API.",
                                   param="page") from None
        # Buckets are aligned to the width (UTC), the first the one holding start_time;
        # what it counts starts at start_time.
        self.since = start
        self.start = _align(start, self.bucket_width)
        self.end = end
        # Superusers hold every permission; a staff user without this one sees their own.
        everyone = user.has_perm("jobs.view_usagerecord")
        user_ids = _int_ids(_list(request, "user_ids"), "user_ids")
        self.filters = usage.Filters(
            owner_id=None if everyone else user.pk, owner_ids=user_ids or None,
            models=_list(request, "models") or None,
            api_key_ids=_int_ids(_list(request, "api_key_ids"), "api_key_ids") or None)
        self.nothing = (request.GET.get("batch") == "false"
                        or bool(_list(request, "project_ids")))

    def page(self, columns: list[str], endpoints: tuple[str, ...] | None = None
             ) -> tuple[list[tuple[datetime, datetime, list[dict[str, Any]]]], str | None]:
        """(bucket start, bucket end, sums per group) for this page's buckets, and the
        next page's cursor (None when this page reaches end_time)."""
        buckets: list[datetime] = []
        at = self.start
        while at < self.end and len(buckets) < self.limit:
            buckets.append(at)
            at += self.step
        more = at < self.end
        page_end = min(at, self.end)
        rows: list[dict[str, Any]] = []
        if buckets and not self.nothing:
            filters = self.filters
            filters.start, filters.end, filters.endpoints = self.since, page_end, endpoints
            rows = usage.bucketed(filters, bucket_width=self.bucket_width, group_by=columns)
        by_bucket: dict[datetime, list[dict[str, Any]]] = {b: [] for b in buckets}
        for row in rows:
            by_bucket.setdefault(_align(row["bucket"], self.bucket_width), []).append(row)
        data = [(b, b + self.step, by_bucket[b]) for b in buckets]
        cursor = base64.urlsafe_b64encode(str(int(at.timestamp())).encode()).decode() \
            if more else None
        return data, cursor


def _align(moment: datetime, width: str) -> datetime:
    moment = moment.astimezone(UTC)
    if width == "1d":
        return moment.replace(hour=0, minute=0, second=0, microsecond=0)
    if width == "1h":
        return moment.replace(minute=0, second=0, microsecond=0)
    return moment.replace(second=0, microsecond=0)


def _page(data: list[dict[str, Any]], cursor: str | None) -> JsonResponse:
    return JsonResponse({"object": "page", "data": data, "has_more": cursor is not None,
                         "next_page": cursor})


def _bucket(start: datetime, end: datetime, results: list[dict[str, Any]]) -> dict[str, Any]:
    return {"object": "bucket", "start_time": int(start.timestamp()),
            "end_time": int(end.timestamp()), "results": results}


def _grouped(row: dict[str, Any], group_by: list[str], names: tuple[str, ...]
             ) -> dict[str, Any]:
    """The group fields of a result: the value when grouped by it, else null."""
    shown: dict[str, Any] = {}
    for name in names:
        value = None
        if name in group_by:
            if name == "model":
                value = row["model"]
            elif name == "api_key_id":
                value = str(row["api_key_id"]) if row["api_key_id"] is not None else None
            elif name == "user_id":
                value = str(row["owner_id"])
            elif name == "batch":
                value = True
        shown[name] = value
    return shown


def _usage(request: HttpRequest, user: Any, *, kind: str) -> JsonResponse:
    groups = ("project_id", "user_id", "api_key_id", "model") + (
        ("batch",) if kind == "completions" else ())
    query = Query(request, user, widths=("1m", "1h", "1d"), groups=groups,
                  limits=LIMITS.get(request.GET.get("bucket_width") or "1d", LIMITS["1d"]))
    columns = [name for name in query.group_by if name in ("model", "api_key_id", "user_id")]
    buckets, cursor = query.page(columns, KINDS[kind])
    data = []
    for start, end, rows in buckets:
        results = []
        for row in _merge(rows, [usage.GROUPS[name] for name in columns]):
            result: dict[str, Any] = {"object": f"organization.usage.{kind}.result",
                                      "input_tokens": row["input_tokens"] or 0}
            if kind == "completions":
                cached = row["cached_tokens"] or 0
                result |= {"output_tokens": row["output_tokens"] or 0,
                           "input_cached_tokens": cached,
                           "input_uncached_tokens": (row["input_tokens"] or 0) - cached,
                           "input_audio_tokens": 0, "output_audio_tokens": 0,
                           "output_reasoning_tokens": row["reasoning_tokens"] or 0}
            result["num_model_requests"] = row["requests_succeeded"] or 0
            result |= _grouped(row, query.group_by, groups)
            results.append(result)
        data.append(_bucket(start, end, results))
    return _page(data, cursor)


def _merge(rows: list[dict[str, Any]], columns: list[str]) -> list[dict[str, Any]]:
    """Rows of one bucket summed over what the result is not grouped by (the Usage page's
    query groups by currency too)."""
    merged: dict[tuple[Any, ...], dict[str, Any]] = {}
    for row in rows:
        key = tuple(row.get(c) for c in columns)
        into = merged.get(key)
        if into is None:
            merged[key] = dict(row)
            continue
        for name in usage.SUMS:
            into[name] = (into[name] or 0) + (row[name] or 0)
    return list(merged.values())


def completions(request: HttpRequest, user: Any) -> JsonResponse:
    return _usage(request, user, kind="completions")


def embeddings(request: HttpRequest, user: Any) -> JsonResponse:
    return _usage(request, user, kind="embeddings")


def moderations(request: HttpRequest, user: Any) -> JsonResponse:
    return _usage(request, user, kind="moderations")


def costs(request: HttpRequest, user: Any) -> JsonResponse:
    groups = ("project_id", "line_item", "api_key_id", "user_id")
    query = Query(request, user, widths=("1d",), groups=groups, limits=COSTS_LIMITS)
    # A line item is a model; every result is one currency's.
    grouped = {"line_item": "model", "api_key_id": "api_key_id", "user_id": "user_id"}
    columns = ["currency", *(grouped[name] for name in query.group_by if name in grouped)]
    buckets, cursor = query.page(columns)
    data = []
    for start, end, rows in buckets:
        results = [{"object": "organization.costs.result",
                    "amount": {"value": float(row["cost_nanos"] or 0) / 10**9,
                               "currency": row["currency"]},
                    "line_item": row["model"] if "line_item" in query.group_by else None,
                    **_grouped(row, query.group_by, ("project_id", "api_key_id", "user_id"))}
                   for row in _merge(rows, [usage.GROUPS[c] for c in columns])]
        data.append(_bucket(start, end, results))
    return _page(data, cursor)


usage_completions = api_view({"GET": completions})
usage_embeddings = api_view({"GET": embeddings})
usage_moderations = api_view({"GET": moderations})
organization_costs = api_view({"GET": costs})
