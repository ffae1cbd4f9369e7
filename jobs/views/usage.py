"""The Usage page: what the user's batches used and cost, by day and model (an SVG chart
like the batch page's throughput chart, and a table), filtered by API key, model and
period, with what is left of the monthly budget; and the same rows as CSV."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date, timedelta
from typing import Any

from django.contrib.auth.decorators import login_required
from django.http import HttpResponse, StreamingHttpResponse
from django.shortcuts import render
from django.views.decorators.http import require_GET

from jobs.http.web import SignedInRequest
from jobs.lib.scale import axis, tick_label
from jobs.models import ApiKey, UsageRecord
from jobs.queries import usage
from jobs.services.budgets import budget_for
from jobs.services.pricing import any_priced, format_cost, priced_models
from jobs.views.forms import UsageFilterForm

CHART_WIDTH = 600
CHART_HEIGHT = 160
# Models beyond the first few (by cost) are drawn together as "other".
CHART_MODELS = 6


@dataclass
class Bar:
    x: float
    y: float
    width: float
    height: float
    series: int  # the model's colour (chart-s0 ...), CHART_MODELS: "other"
    title: str


def _filters(request: SignedInRequest) -> tuple[UsageFilterForm, usage.Filters, int]:
    keys = list(ApiKey.objects.filter(owner=request.user).order_by("-created_at")
                .values_list("pk", "name"))
    models = sorted(UsageRecord.objects.filter(owner=request.user).order_by()
                    .values_list("model", flat=True).distinct())
    form = UsageFilterForm(request.GET or None, keys=keys, models=models)
    data = form.cleaned_data if form.is_valid() else {}
    days = data.get("days") or 30
    start, end = usage.day_range(days)
    filters = usage.Filters(owner_id=request.user.pk, start=start, end=end,
                            models=[data["model"]] if data.get("model") else None,
                            api_key_ids=[data["key"]] if data.get("key") else None)
    return form, filters, days


def chart(rows: list[dict[str, Any]], *, start: date, days: int) -> dict[str, Any] | None:
    """Stacked bars of cost per day, one colour per model (the costliest CHART_MODELS, the
    rest as "other"), on a scale from 0 to a round top above the busiest day; tokens when
    nothing cost anything (no prices set)."""
    measure = "cost_nanos" if any(r["cost_nanos"] for r in rows) else "tokens"
    totals: dict[str, float] = {}
    by_day: dict[int, dict[str, float]] = {}
    for row in rows:
        value = float(row["cost_nanos"] if measure == "cost_nanos"
                      else row["input_tokens"] + row["output_tokens"])
        day = (row["bucket"].date() - start).days
        by_day.setdefault(day, {})
        by_day[day][row["model"]] = by_day[day].get(row["model"], 0.0) + value
        totals[row["model"]] = totals.get(row["model"], 0.0) + value
    peak = max((sum(d.values()) for d in by_day.values()), default=0.0)
    if peak <= 0:
        return None
    # Ticks in money (the currency in the axis's unit) or tokens.
    scale = axis(peak, height=CHART_HEIGHT, label=(
        (lambda value: tick_label(value / 1e9)) if measure == "cost_nanos" else tick_label))
    ranked = sorted(totals, key=lambda m: -totals[m])
    series = {m: min(i, CHART_MODELS) for i, m in enumerate(ranked)}
    width = CHART_WIDTH / days
    bars = []
    for day, values in sorted(by_day.items()):
        y = float(CHART_HEIGHT)
        for model in sorted(values, key=lambda m: series[m]):
            height = CHART_HEIGHT * values[model] / scale.top
            y -= height
            shown = (format_cost(int(values[model])) if measure == "cost_nanos"
                     else f"{int(values[model]):,} tokens")
            bars.append(Bar(x=day * width + width * 0.1, y=y, width=width * 0.8,
                            height=height, series=series[model],
                            title=f"{start + timedelta(days=day)} {model}: {shown}"))
    legend = [(min(i, CHART_MODELS), m if i < CHART_MODELS else "other")
              for i, m in enumerate(ranked) if i <= CHART_MODELS]
    return {"bars": bars, "legend": legend, "width": CHART_WIDTH, "height": CHART_HEIGHT,
            "measure": "cost" if measure == "cost_nanos" else "tokens", "axis": scale,
            "unit": f"{rows[0]['currency'].upper()} a day" if measure == "cost_nanos"
            else "tokens a day",
            "peak": format_cost(int(peak)) if measure == "cost_nanos" else f"{int(peak):,}"}


@login_required
@require_GET
def usage_page(request: SignedInRequest) -> HttpResponse:
    form, filters, days = _filters(request)
    # Eval runs' requests (of sets attached to batches) on rows of their own.
    rows = usage.bucketed(filters, bucket_width="1d",
                          group_by=["model", "currency", "eval_run"])
    total = usage.totals(filters)
    start = filters.start.date() if filters.start else date.today()
    currency = rows[0]["currency"] if rows else "usd"
    # A row is priced if it was charged, or its model has a price now (a charge of zero
    # then is money too); the total if a row is (with no rows: if any model has a price).
    models = priced_models({row["model"] for row in rows})
    priced = [bool(row["cost_nanos"]) or row["model"] in models for row in rows]
    table = [{**row, "cost": format_cost(row["cost_nanos"] or 0, row["currency"], priced=p)}
             for row, p in reversed(list(zip(rows, priced, strict=True)))]
    return render(request, "jobs/usage.html", {
        "form": form, "chart": chart(rows, start=start, days=days), "rows": table,
        "total": {**total, "cost": format_cost(total["cost_nanos"], currency, priced=any(
            priced) if rows else any_priced())},
        "budget": budget_for(request.user), "days": days,
        "query": request.GET.urlencode()})


@login_required
@require_GET
def usage_csv(request: SignedInRequest) -> StreamingHttpResponse:
    """The Usage page's rows as CSV: per day, model and API key."""
    _, filters, _ = _filters(request)
    rows = usage.bucketed(filters, bucket_width="1d",
                          group_by=["model", "api_key_id", "currency"])
    response = StreamingHttpResponse(
        usage.csv_lines(rows, ["bucket", "model", "api_key_id"]),
        content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = 'attachment; filename="usage.csv"'
    return response
