"""The usage ledger: what each finished shard used and cost, one UsageRecord per (shard,
model), written by `finish_shard` in the transaction that marks the shard done under its
attempt.

Why the shard: it is the unit that finishes exactly once. Its results become final in one
fenced UPDATE (`status = done WHERE attempt = N AND status = running`), so a charge written
in that same transaction commits exactly when the results do: a zombie's late finish, a
retried or resumed attempt, a shard handed back in a drain and finished elsewhere, each
finishes the shard at most once, and a crash between the two writes is impossible. Charging
per batch would wait for the finalizer (a run of several days shows nothing meanwhile) and
would need its own idempotence; charging per request would write a row per request.
The unique (shard_id, model) constraint states the rule in the schema as well. The same
transaction adds the rows to their day's sums (UsageDay), which long reads sum instead.

Shards that never finish (dropped on cancel or expiry, abandoned after their retries)
charge nothing: their requests are all error lines.
"""

from __future__ import annotations

from datetime import UTC
from typing import Any

from django.db import connection
from django.utils import timezone

from jobs.formats.checkpoint_record import ShardUsage
from jobs.models import EvalRun, Shard, UsageDay, UsageRecord
from jobs.services.pricing import rates_for


def record_shard_usage(*, shard_id: str, progress: Any, usage: ShardUsage | None) -> None:
    """Charge a shard that has just been marked done: call inside that transaction, after
    the fenced UPDATE succeeded. `progress`: the shard's final counters (Progress)."""
    usage = usage or ShardUsage()
    batch = (Shard.objects.filter(pk=shard_id)
             .values("batch_id", "batch__owner_id", "batch__api_key_id", "batch__model",
                     "batch__endpoint").get())
    # An eval run's requests are charged to whoever attached the set to their batch (the
    # operator's watching sets stay the service user's, who owns every run's batch).
    run = (EvalRun.objects.filter(run_batch_id=batch["batch_id"])
           .values("trigger", "batch__owner_id", "batch__api_key_id").first())
    owner_id, api_key_id = batch["batch__owner_id"], batch["batch__api_key_id"]
    if run is not None and run["trigger"] == EvalRun.Trigger.BATCH:
        owner_id, api_key_id = run["batch__owner_id"], run["batch__api_key_id"]
    base = batch["batch__model"]
    rows: dict[str, list[int]] = {}
    adapters = {k: v for k, v in usage.adapters.items() if k != base}
    for model, counts in adapters.items():
        rows[model] = list(counts)
    # The batch's model takes the rest, failures included (a failure costs nothing).
    rest = [progress.completed, progress.input_tokens, progress.cached_tokens,
            progress.output_tokens, progress.reasoning_tokens]
    for counts in adapters.values():
        rest = [max(0, a - b) for a, b in zip(rest, counts, strict=True)]
    if any(rest) or progress.failed or not rows:
        rows[base] = rest
    rates = rates_for(set(rows), base_model=base)
    total_requests = sum(counts[0] for counts in rows.values()) or 1
    now = timezone.now()
    records = []
    for model, (succeeded, tokens_in, cached, tokens_out, reasoning) in rows.items():
        rate = rates[model]
        records.append(UsageRecord(
            owner_id=owner_id, api_key_id=api_key_id, eval_run=run is not None,
            batch_id=batch["batch_id"], shard_id=shard_id, model=model, base_model=base,
            endpoint=batch["batch__endpoint"], requests_succeeded=succeeded,
            requests_failed=progress.failed if model == base else 0,
            input_tokens=tokens_in, cached_tokens=cached, output_tokens=tokens_out,
            reasoning_tokens=reasoning,
            # Reasoning tokens are output tokens, priced as such (as OpenAI bills them).
            cost_nanos=rate.cost_nanos(input_tokens=tokens_in, cached_tokens=cached,
                                       output_tokens=tokens_out),
            currency=rate.currency, input_price=rate.input, cached_price=rate.cached,
            output_price=rate.output,
            engine_seconds=usage.engine_seconds * succeeded / total_requests
            if len(rows) > 1 else usage.engine_seconds,
            recorded_at=now))
    UsageRecord.objects.bulk_create(records)
    add_to_days(records)


_DAY_KEY = ("day", "owner_id", "api_key_id", "model", "endpoint", "currency", "eval_run")
_DAY_SUMS = ("requests_succeeded", "requests_failed", "input_tokens", "cached_tokens",
             "output_tokens", "reasoning_tokens", "cost_nanos", "engine_seconds")


def add_to_days(records: list[UsageRecord]) -> None:
    """Add ledger rows to their UsageDay rows (created when missing): one INSERT ... ON
    CONFLICT DO UPDATE, which PostgreSQL and SQLite both run atomically for each row."""
    table = connection.ops.quote_name(UsageDay._meta.db_table)
    columns = (*_DAY_KEY, *_DAY_SUMS)
    values: list[Any] = []
    for r in records:
        values.extend((r.recorded_at.astimezone(UTC).date(), r.owner_id, r.api_key_id or 0,
                       r.model, r.endpoint, r.currency, r.eval_run,
                       *(getattr(r, name) for name in _DAY_SUMS)))
    row = "(" + ", ".join(["%s"] * len(columns)) + ")"
    adds = ", ".join(f"{name} = {table}.{name} + EXCLUDED.{name}" for name in _DAY_SUMS)
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {table} ({', '.join(columns)}) VALUES "
            f"{', '.join([row] * len(records))} "
            f"ON CONFLICT ({', '.join(_DAY_KEY)}) DO UPDATE SET {adds}", values)
