"""Read-side numbers of the dashboard: progress, throughput (now, average, over time) and
the run report (what a run cost and how it went). When a batch is expected to end is the
capacity plan's projection (Batch.projection), not an estimate of its own here.
The throughput-over-time series is data only; `templatetags.dashboard.throughput_chart`
draws it.

Nothing here writes. Throughput is derived from the shard rows alone: a shard's live
counters say how many requests the engine ran for its current attempt between `started_at`
and now (or `finished_at`); we spread those evenly over that interval. That is exact for the
average and a fair estimate for "now" and for the chart, without recording per-request
times. Only what the engine ran counts (Shard.ran_ok, ran_failed): lines kept from running,
dedup copies and lines written unrun take no engine time, and counted, three refused lines
written in a millisecond would read as thousands of requests a minute.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.utils import timezone

from jobs.lib.compiled import Compiled
from jobs.models import Batch, Shard

# "Now" is the last two minutes: long enough to smooth shard boundaries, short enough to
# follow a worker joining or leaving.
RECENT_WINDOW = timedelta(minutes=2)
CHART_BUCKETS = 30

SHARD_FIELDS = ("batch_id", "status", "started_at", "finished_at", "completed", "failed",
                "attempt", "failures", "input_tokens", "output_tokens", "request_count",
                "json_retries", "recomputed", "ran_ok", "ran_failed")


@dataclass
class ShardRow:
    batch_id: str
    status: str
    started_at: datetime | None
    finished_at: datetime | None
    completed: int
    failed: int
    attempt: int
    failures: int
    input_tokens: int
    output_tokens: int
    request_count: int = 0
    json_retries: int = 0
    recomputed: int = 0
    ran_ok: int = 0
    ran_failed: int = 0

    @property
    def engine_runs(self) -> int:
        """The requests the engine ran for this attempt (with the checkpoint it adopted)."""
        return self.ran_ok + self.ran_failed

    @property
    def ran(self) -> bool:
        # Abandoned shards report all their requests failed at once without running them;
        # counting them as throughput would show a spike of work that never happened.
        return self.started_at is not None and self.status in (Shard.Status.RUNNING,
                                                               Shard.Status.DONE)

    def interval(self, now: datetime) -> tuple[datetime, datetime]:
        assert self.started_at is not None
        return self.started_at, self.finished_at or now

    def done_between(self, start: datetime, end: datetime, now: datetime) -> float:
        """Requests the engine ran for this attempt in [start, end), spread evenly over its
        run."""
        if not self.ran:
            return 0.0
        s, e = self.interval(now)
        count = self.engine_runs
        length = (e - s).total_seconds()
        if length <= 0:
            return float(count) if start <= e < end else 0.0
        overlap = (min(e, end) - max(s, start)).total_seconds()
        return count * max(0.0, overlap) / length


# The shards of one batch: what the live block of a running batch, and a list with one
# running batch, read on every poll of a change; compiled once.
_ONE_BATCH = Compiled(lambda batch_id: Shard.objects.filter(batch_id=batch_id).order_by()
                      .values_list(*SHARD_FIELDS), "batch_id")


def shard_rows(batch_ids: Iterable[str]) -> dict[str, list[ShardRow]]:
    """The shards of several batches in one query, grouped by batch."""
    grouped: dict[str, list[ShardRow]] = {}
    ids = list(batch_ids)
    for values in (_ONE_BATCH.rows(batch_id=ids[0]) if len(ids) == 1 else
                   Shard.objects.filter(batch_id__in=ids).order_by().values_list(*SHARD_FIELDS)):
        row = ShardRow(*values)
        grouped.setdefault(row.batch_id, []).append(row)
    return grouped


@dataclass
class Report:
    """The run report: retries, failures and cost of a run, for the batch page."""

    completions_per_minute: float | None
    # The share of request runs that were repeats: the requests computed again because
    # the shard attempt that computed them ended unfinished before checkpointing them
    # (a retry resumes from the checkpoint: only those run twice) plus the requests run a
    # second time because their JSON output did not parse or match the schema, over every
    # request run.
    retry_rate: float | None
    claims: int  # shard runs
    failures: int  # failed shard runs
    recomputed: int
    json_retries: int
    retried_requests: int
    request_runs: int
    # Input tokens per request the engine completed (prompt tokens actually computed, over
    # the requests that computed them: dedup copies, which cost none, are not counted).
    mean_context_tokens: float | None
    slowest_shard_seconds: float | None
    # The share of input tokens the engine served from its prefix cache (vLLM's cached
    # prompt tokens), and how validation planned the shards (PrefixPlan as stored).
    cache_hit_rate: float | None = None
    cached_tokens: int = 0
    # The limit: the most of the input tokens a prefix cache could serve (each distinct
    # prompt block of a shard computed once; engine.prefix_limit), as a share too, and the
    # share of it the run reached.
    cacheable_tokens: int = 0
    cacheable_rate: float | None = None
    of_cacheable: float | None = None
    plan: dict = field(default_factory=dict)


@dataclass
class BatchProgress:
    """How far a batch is, in requests, and the shares the progress bars draw (percent of
    the total, one decimal; the failed share never pushes the bar past 100%)."""

    total: int
    completed: int
    failed: int

    @classmethod
    def of(cls, batch: Batch) -> BatchProgress:
        progress = batch.progress()
        return cls(total=batch.total or 0, completed=progress["completed"],
                   failed=progress["failed"])

    @property
    def done(self) -> int:
        return self.completed + self.failed

    @property
    def remaining(self) -> int:
        return max(0, self.total - self.done)

    def _pct(self, value: int) -> float:
        return round(100.0 * value / self.total, 1) if self.total else 0.0

    @property
    def percent(self) -> float:
        return self._pct(self.done)

    @property
    def percent_completed(self) -> float:
        return self._pct(self.completed)

    @property
    def percent_failed(self) -> float:
        return min(self._pct(self.failed), 100.0 - self.percent_completed)


@dataclass
class BatchStats(BatchProgress):
    input_tokens: int
    output_tokens: int
    rate_now: float | None  # requests per second over RECENT_WINDOW (running batches)
    rate_avg: float | None  # requests per second since the batch started running
    elapsed_seconds: float | None
    report: Report
    # Requests per minute over time (CHART_BUCKETS buckets from in_progress to the end or
    # now); empty before the batch runs.
    throughput: list[float]
    timeline: list[tuple[str, datetime]] = field(default_factory=list)


TIMELINE = (("created", "created_at"), ("in progress", "in_progress_at"),
            ("finalizing", "finalizing_at"), ("cancelling", "cancelling_at"),
            ("completed", "completed_at"), ("failed", "failed_at"),
            ("expired", "expired_at"), ("cancelled", "cancelled_at"))


def timeline(batch: Batch) -> list[tuple[str, datetime]]:
    stamps = [(label, getattr(batch, attr)) for label, attr in TIMELINE if getattr(batch, attr)]
    return sorted(stamps, key=lambda item: item[1])


def _rates(batch: Batch, rows: list[ShardRow], now: datetime) -> tuple[
        float | None, float | None, float | None]:
    """(rate now, average rate, elapsed seconds) in requests per second."""
    if batch.in_progress_at is None:
        return None, None, None
    end = batch.ended_at or now
    elapsed = max((end - batch.in_progress_at).total_seconds(), 0.001)
    ran = sum(r.engine_runs for r in rows if r.ran)
    rate_avg = ran / elapsed if ran else 0.0
    rate_now = None
    if not batch.is_ended:
        window = min(RECENT_WINDOW, end - batch.in_progress_at)
        seconds = max(window.total_seconds(), 0.001)
        rate_now = sum(r.done_between(now - window, now + timedelta(seconds=1), now)
                       for r in rows) / seconds
    return rate_now, rate_avg, elapsed


def batch_stats(batch: Batch, *, now: datetime | None = None) -> BatchStats:
    now = now or timezone.now()
    rows = shard_rows([batch.pk]).get(batch.pk, [])
    progress = batch.progress()
    rate_now, rate_avg, elapsed = _rates(batch, rows, now)
    claims = sum(r.attempt for r in rows)
    failures = sum(r.failures for r in rows)
    json_retries = sum(r.json_retries for r in rows)
    recomputed = sum(r.recomputed for r in rows)
    retried = recomputed + json_retries
    runs = sum(r.request_count for r in rows if r.attempt) + retried
    ran_ok = sum(r.ran_ok for r in rows)
    durations = [(r.finished_at - r.started_at).total_seconds() for r in rows
                 if r.status == Shard.Status.DONE and r.started_at and r.finished_at]
    report = Report(
        completions_per_minute=(progress["completed"] / elapsed * 60) if elapsed else None,
        retry_rate=(retried / runs) if runs else None,
        claims=claims, failures=failures, recomputed=recomputed, json_retries=json_retries,
        retried_requests=retried, request_runs=runs,
        mean_context_tokens=(sum(r.input_tokens for r in rows) / ran_ok if ran_ok else None),
        slowest_shard_seconds=max(durations) if durations else None,
        cache_hit_rate=(progress["cached_tokens"] / progress["input_tokens"]
                        if progress["input_tokens"] else None),
        cached_tokens=progress["cached_tokens"], plan=batch.plan or {},
        cacheable_tokens=progress["cacheable_tokens"],
        cacheable_rate=(progress["cacheable_tokens"] / progress["input_tokens"]
                        if progress["input_tokens"] else None),
        of_cacheable=(min(1.0, progress["cached_tokens"] / progress["cacheable_tokens"])
                      if progress["cacheable_tokens"] else None),
    )
    return BatchStats(
        total=batch.total, completed=progress["completed"], failed=progress["failed"],
        input_tokens=progress["input_tokens"], output_tokens=progress["output_tokens"],
        rate_now=rate_now, rate_avg=rate_avg, elapsed_seconds=elapsed,
        report=report, throughput=throughput_series(batch, rows, now), timeline=timeline(batch))


def throughput_series(batch: Batch, rows: list[ShardRow], now: datetime,
                      buckets: int = CHART_BUCKETS) -> list[float]:
    """Requests per minute in equal time buckets from in_progress to the end (or now).

    Each shard adds its requests to the few buckets its run overlaps, in proportion to the
    overlap: one pass over the shards (a 1M-request batch has ~1,000 of them, polled every
    2 s), not one pass per bucket."""
    if batch.in_progress_at is None:
        return []
    start = batch.in_progress_at
    span = ((batch.ended_at or now) - start).total_seconds()
    if span <= 0:
        return []
    step = span / buckets
    # The last bucket reaches one second past the end: requests finished at the very end.
    top = buckets + 1 / step
    counts = [0.0] * buckets
    for row in rows:
        if not row.ran:
            continue
        s, e = row.interval(now)
        count = row.engine_runs
        # The run in bucket units: bucket i covers [i, i + 1).
        first = (s - start).total_seconds() / step
        last = (e - start).total_seconds() / step
        if last <= first:  # no length: all of it where it ended
            if 0 <= last < top:
                counts[min(int(last), buckets - 1)] += count
            continue
        per_unit = count / (last - first)
        for i in range(max(0, int(first)), min(buckets, int(last) + 1)):
            upper = top if i == buckets - 1 else i + 1
            overlap = min(last, upper) - max(first, i)
            if overlap > 0:
                counts[i] += per_unit * overlap
    return [count / step * 60 for count in counts]
