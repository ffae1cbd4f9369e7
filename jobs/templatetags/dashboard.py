"""Display helpers: untrusted text made safe to look at, durations, rates, JSON previews,
and the throughput chart drawn as SVG path data.

Django escapes HTML already; `clip` adds what escaping does not cover: huge strings are cut,
and invisible or direction-changing characters (bidi overrides, zero-width, control
characters) are shown as visible escapes so content cannot disguise itself or the page.
"""

from __future__ import annotations

import json
import re
import unicodedata
from dataclasses import dataclass
from typing import Any

from django import template
from django.utils.html import escape, format_html
from django.utils.safestring import SafeString, mark_safe

from engine.endpoints import show_request, show_response
from jobs.lib import release
from jobs.lib.scale import Axis, axis

register = template.Library()

DEFAULT_CLIP = 300
# More combining marks than this on one character ("zalgo" text) are dropped: they draw
# over neighbouring lines.
MAX_COMBINING = 2


def _visible(text: str) -> str:
    out = []
    combining = 0
    for ch in text:
        if ch in "\n\t":
            out.append(ch)
            combining = 0
            continue
        category = unicodedata.category(ch)
        if category in ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"):
            out.append(f"\\u{ord(ch):04x}" if ord(ch) <= 0xFFFF else f"\\U{ord(ch):08x}")
            combining = 0
        elif category in ("Mn", "Me"):
            combining += 1
            if combining <= MAX_COMBINING:
                out.append(ch)
        else:
            combining = 0
            out.append(ch)
    return "".join(out)


@register.filter
def clip(value: Any, limit: int = DEFAULT_CLIP) -> str:
    """`value` as text of at most `limit` characters (plus a note of how much was cut),
    with invisible characters made visible. The result is still escaped by the template."""
    if value is None:
        return ""
    text = value if isinstance(value, str) else str(value)
    limit = int(limit)
    cut = len(text) - limit
    if cut > 0:
        text = text[:limit]
    text = _visible(text)
    return f"{text}… (+{cut:,} characters)" if cut > 0 else text


@register.filter
def pretty(value: Any, limit: int = 4000) -> str:
    """JSON, indented, clipped (for <pre> blocks)."""
    if value is None:
        return ""
    try:
        text = json.dumps(value, indent=2, ensure_ascii=False)
    except (TypeError, ValueError):
        text = str(value)
    return clip(text, limit)


@register.filter
def duration(seconds: Any) -> str:
    """1h 02m, 3m 05s, 42s; an em dash when unknown."""
    if seconds is None:
        return "—"
    seconds = int(round(float(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    minutes, secs = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m {secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h {minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d {hours}h"


@register.filter
def per_minute(rate_per_second: Any) -> str:
    if rate_per_second is None:
        return "—"
    return f"{float(rate_per_second) * 60:,.1f}/min"


@register.filter
def number(value: Any, digits: int = 0) -> str:
    if value is None:
        return "—"
    return f"{float(value):,.{int(digits)}f}"


@register.filter
def percent(value: Any, digits: int = 1) -> str:
    if value is None:
        return "—"
    return f"{float(value) * 100:.{int(digits)}f}%"


# Where a long name may wrap: after these, never inside a word.
_BREAKS = re.compile(r"(?<=[_\-./])")


@register.filter
def breakable(value: Any) -> SafeString:
    """`value` (escaped) with a line-break opportunity (<wbr>) after each '_', '-', '.' and
    '/': a file name such as batch_6f1c_output.jsonl wraps between its parts."""
    return mark_safe("<wbr>".join(escape(part) for part in _BREAKS.split(str(value))))


@register.simple_tag
def status_badge(batch: Any, element_id: str = "") -> SafeString:
    """A batch's status badge. A batch that completed without one request succeeding says
    so, in the failure colour: "Completed" in green would hide that all of it failed."""
    status, label = batch.status, batch.get_status_display()
    if status == "completed" and not batch.completed and batch.failed:
        status, label = "failed", f"{label}, all failed"
    return format_html('<span class="badge st-{}"{}>{}</span>', status,
                       format_html(' id="{}"', element_id) if element_id else "", label)


@register.filter
def request_text(line: Any) -> str:
    """The human part of an input line, as its endpoint shows it: the messages (of a chat,
    Responses or Messages request; an Anthropic request's system prompt first), prompt or
    input, or the inputs of a score or rerank request's two sides, one a line."""
    body = line.get("body") if isinstance(line, dict) else None
    if not isinstance(body, dict):
        return ""
    return show_request(line.get("url"), body)


@register.filter
def response_text(body: Any) -> str:
    """The human part of a response body, as the endpoint whose answer it is shows it: the
    first choice's text, a Responses answer's text, an Anthropic Message's text blocks, an
    embedding's size, the scores of a score list (one a pair) or a rerank's documents by
    relevance; an error's message."""
    if not isinstance(body, dict):
        return ""
    return show_response(body)


CHART_WIDTH = 600
CHART_HEIGHT = 120


@dataclass
class Chart:
    """A throughput-over-time chart as SVG path data (the template draws the <svg>), with
    its y axis in requests a minute."""

    line: str
    area: str
    max_per_minute: float
    axis: Axis
    width: int = CHART_WIDTH
    height: int = CHART_HEIGHT


@register.simple_tag
def throughput_chart(series: list[float]) -> Chart | None:
    """`{% throughput_chart stats.throughput as chart %}`: the chart of a requests-per-minute
    series (equal time buckets), on a scale from 0 to a round top above its peak; None when
    nothing ran yet."""
    if not series or max(series) <= 0:
        return None
    scale = axis(max(series), height=CHART_HEIGHT)
    n = len(series)
    points = []
    for i, value in enumerate(series):
        # Each bucket is drawn at its middle; the line starts and ends at the edges.
        x = CHART_WIDTH * (i + 0.5) / n
        points.append((x, scale.y(value, CHART_HEIGHT)))
    points = [(0.0, points[0][1]), *points, (float(CHART_WIDTH), points[-1][1])]
    line = "M" + " L".join(f"{x:.1f},{y:.1f}" for x, y in points)
    area = f"{line} L{CHART_WIDTH},{CHART_HEIGHT} L0,{CHART_HEIGHT} Z"
    return Chart(line=line, area=area, max_per_minute=max(series), axis=scale)


@register.simple_tag
def batchweb_version() -> str:
    """The release serving the page (the footer): what an operator checks after an upgrade."""
    return release.version()
