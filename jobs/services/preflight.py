"""The new-batch form's preflight: check a file before any batch exists, with the very check
validation runs (content rules included), say what the batch will cost, and (when the user
picks another model than the file names) write a copy of the file for that model."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db.models import Max, Min, Sum
from django.utils import timezone

from jobs.lib.heavy import Guard, cached, version
from jobs.lib.model_registry import served_endpoints
from jobs.models import ContentRule, File, LoraAdapter, Shard
from jobs.services.budgets import Estimate
from jobs.services.files import create_input_file
from jobs.services.grants import check_source_readable
from jobs.services.validation import InputReport, check_batch_input
from jobs.storage.lines import iter_lines
from jobs.storage.objects import open_file
from jobs.storage.temp import local_temp

# The estimate uses the model's shards that finished within this window.
MODEL_HISTORY = timedelta(hours=1)


@dataclass
class Preflight:
    report: InputReport
    # Requests per second measured for the model recently; None: no history.
    rate: float | None
    estimated_seconds: float | None

    @property
    def ok(self) -> bool:
        return self.report.ok

    @property
    def cost(self) -> Estimate:
        """The most the batch could cost (jobs.services.budgets)."""
        return self.report.cost


def check_path(path: str | Path, *, endpoint: str | None = None,
               strict: bool = False) -> Preflight:
    with open(path, "rb") as stream:
        return _preflight(check_batch_input(stream, endpoint=endpoint, strict=strict))


def check_file(file: File, *, endpoint: str | None = None, strict: bool = False,
               guard: Guard | None = None) -> Preflight:
    """The preflight of a stored file. Its check (a pass over the whole file) is cached by
    what decides it: the file's content, the endpoint asked for, the enabled content rules
    (any change to one makes a new key) and this deployment's limits, models and adapters; so
    picking the same file again costs one cache read. `guard` is entered only to check."""
    check_source_readable(file=file, param="file_id")
    depends = version(file.sha256 or file.storage_name, endpoint, strict, _rules_version(),
                      sorted(settings.BATCHWEB.items()), served_endpoints(),
                      sorted(LoraAdapter.objects.usable().items()))
    key = f"preflight:{file.pk}:{depends}"

    def check() -> InputReport:
        with open_file(file) as stream:
            return check_batch_input(stream, endpoint=endpoint, strict=strict)

    return _preflight(cached(key, check, guard=guard))


def _rules_version() -> list[tuple[Any, ...]]:
    """Every field of every enabled content rule: what `Screener.load` reads."""
    fields = [f.attname for f in ContentRule._meta.concrete_fields]
    return list(ContentRule.objects.filter(enabled=True).order_by("pk").values_list(*fields))


def _preflight(report: InputReport) -> Preflight:
    rate = model_throughput(report.model) if report.model else None
    return Preflight(report=report, rate=rate,
                     estimated_seconds=estimate_seconds(report.requests, rate))


def model_throughput(model: str, *, now: datetime | None = None) -> float | None:
    """Requests per second this deployment recently sustained for a model: the requests the
    engine ran for its shards that finished within MODEL_HISTORY (not the lines refused
    before running nor dedup copies, which take no engine time), over the time from the
    first of them starting to the last finishing (so shards running side by side count
    once). None when there is no such history."""
    now = now or timezone.now()
    agg = Shard.objects.filter(
        batch__model=model, status=Shard.Status.DONE, started_at__isnull=False,
        finished_at__gte=now - MODEL_HISTORY).aggregate(
        requests=Sum("ran_ok"), failed=Sum("ran_failed"), first=Min("started_at"),
        last=Max("finished_at"))
    requests = (agg["requests"] or 0) + (agg["failed"] or 0)
    if not requests or agg["first"] is None:
        return None
    seconds = max((agg["last"] - agg["first"]).total_seconds(), 1.0)
    return requests / seconds


def estimate_seconds(requests: int, rate: float | None) -> float | None:
    return math.ceil(requests / rate) if rate else None


def with_model(*, file: File, model: str, owner: Any) -> File:
    """A new input file: `file` with every request's body.model set to `model`, streamed
    line by line. Lines are re-serialized, so their formatting may change, not their data."""
    check_source_readable(file=file, param="file_id")
    with local_temp(".model") as path:
        with open(path, "wb") as target, open_file(file) as stream:
            for line in iter_lines(stream, max_line_bytes=settings.BATCHWEB["MAX_LINE_BYTES"]):
                if not line.content or not line.content.strip():
                    continue
                obj = json.loads(line.content)
                if isinstance(obj, dict) and isinstance(obj.get("body"), dict):
                    obj["body"]["model"] = model
                target.write(json.dumps(obj, ensure_ascii=False).encode() + b"\n")
        stem = file.filename.rsplit(".", 1)[0]
        return create_input_file(owner=owner, path=path, filename=f"{stem}.{model}.jsonl",
                                 purpose="batch")
