"""`/metrics` in the Prometheus text format.

Every value is read from the database and Redis at scrape time by a custom collector in a
fresh registry: the numbers are the service's, not one web process's (Granian runs several,
and workers run on other machines). Counters (`*_total`) are sums over the shards in the
database, so they drop if an operator deletes batches; Prometheus' rate() treats a drop as
a reset.

Access: "Authorization: Bearer <BATCHWEB_METRICS_TOKEN>" (Prometheus' `authorization`
setting), or a signed-in staff user.

    batchweb_batches{status}                        batches by status
    batchweb_queue_depth{queue,model,priority}      jobs waiting in each RQ queue
    batchweb_shards_in_flight{model,state}          shards queued (in Redis or waiting their
                                                    turn in the database) or running
    batchweb_shards_stuck{model}                    running shards with a stale heartbeat
    batchweb_model_blocked{model}                   1: work waiting, no live worker or no Redis
    batchweb_requests_processed_total{model,outcome} requests of finished shards
                                                    (outcome: completed | failed)
    batchweb_tokens_processed_total{model,kind}     tokens of successful requests
                                                    (kind: input | output)
    batchweb_usage_tokens_total{model,kind}         tokens charged in the usage ledger, by
                                                    the request's model or adapter (kind:
                                                    input | cached_input | output; input
                                                    counts the cached ones too)
    batchweb_usage_cost_total{model,currency}       what the ledger charged, in the currency
    batchweb_usage_engine_seconds_total{model}      the engine's time the charged work took
    batchweb_throughput_requests_per_second{model}  requests of shards finished in the last
                                                    5 minutes, per second
    batchweb_workers{model}                         live batchworkers serving a model
    batchweb_workers_total                          live RQ workers
    batchweb_host_up{host}                          1 if a worker of the host is alive, 0
                                                    when all its registered workers are
                                                    lost (the machine died or is cut off)
    batchweb_host_workers{host,model,state}         registered workers per host by state
                                                    (idle, busy, ..., lost)
    batchweb_host_shards_held{host}                 running shards held by its workers
    batchweb_host_heartbeat_age_seconds{host}       since its newest worker heartbeat
    batchweb_webhook_events{status}                 webhook events by delivery status
    batchweb_batches_eval_drift                     batches an eval run flagged: it scored
                                                    below its set's baseline by more than
                                                    the set's threshold
    batchweb_eval_runs{eval_set,model,status}       eval runs by set, model and status
                                                    (eval_set: the set's id, evalset_N; only
                                                    runs whose batch is active or of the
                                                    last 24 hours, at most 100 sets)
    batchweb_eval_score{eval_set,model}             the newest scored run's score (0 to 1),
                                                    for the same sets
    batchweb_workers_needed{model}                  the fewest workers of the model that
                                                    finish every running batch inside its
                                                    window, less the capacity margin; 0
                                                    when nothing is left to run (what an
                                                    autoscaler scales on)
    batchweb_batches_at_risk{model}                 running batches projected past their
                                                    window on the workers alive now
    batchweb_worker_tokens_per_second{model,worker,kind}  a live worker's prompt and output
                                                    tokens per second while busy
    batchweb_redis_up                               1 if Redis answered
    batchweb_remote_in_flight{server}               requests in flight on a remote server
                                                    (all workers), batchweb_remote_limit
                                                    {server} its adaptive limit,
                                                    batchweb_remote_ceiling{server} its
                                                    ceiling, batchweb_remote_condition
                                                    {server,condition} ok | busy |
                                                    unreachable
    batchweb_remote_backoffs_total{server}          retries waited for
    batchweb_remote_errors_total{server}            requests failed with its error
    batchweb_remote_limit_reason{server,reason}     1 for why the limit is where it is
                                                    (slo, paused, deadline_floor, ceiling,
                                                    ...)
    batchweb_remote_ttft_slo_seconds{server}        its online TTFT SLO, at
                                                    batchweb_remote_ttft_slo_percentile
    batchweb_remote_online_ttft_seconds{server}     online users' TTFT now (at that
                                                    percentile), ..._alone_ttft_seconds
                                                    with no batch request in flight
    batchweb_remote_online_ttft_samples{server,     the samples that figure holds, and its
        measure}                                    measure (histogram | probes)
    batchweb_remote_deadline_floor{server}          requests in flight its batches' windows
                                                    need (the SLO steers no lower)
"""

from __future__ import annotations

import hmac
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db.models import Count, F, Max, Q, Sum
from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from django.views.decorators.http import require_GET
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from engine.remote_limits import REASONS
from jobs.capacity.plan import live_workers
from jobs.lib import queues
from jobs.lib.model_registry import model_names
from jobs.models import Batch, Shard, UsageDay, WebhookEvent
from jobs.queries.queue_health import Health, queue_health, shard_counts_by_model

THROUGHPUT_WINDOW = timedelta(minutes=5)


def _usage_metrics() -> Iterator[Metric]:
    """The usage ledger's sums, from its daily sums (UsageDay, written with each ledger row:
    the same totals, a few hundred rows a day). The ledger outlives deleted batches, so
    these counters never drop."""
    tokens = CounterMetricFamily("batchweb_usage_tokens", "Tokens charged in the usage ledger.",
                                 labels=["model", "kind"])
    cost = CounterMetricFamily("batchweb_usage_cost", "What the usage ledger charged.",
                               labels=["model", "currency"])
    engine = CounterMetricFamily("batchweb_usage_engine_seconds",
                                 "The engine's time the charged work took.", labels=["model"])
    rows = (UsageDay.objects.order_by().values("model", "currency")
            .annotate(input=Sum("input_tokens"), cached=Sum("cached_tokens"),
                      output=Sum("output_tokens"), nanos=Sum("cost_nanos"),
                      seconds=Sum("engine_seconds")).order_by("model", "currency"))
    # Per model across currencies (a model repriced in another currency has two rows).
    by_model: dict[str, list[float]] = {}
    for row in rows:
        sums = by_model.setdefault(row["model"], [0, 0, 0, 0.0])
        sums[0] += row["input"] or 0
        sums[1] += row["cached"] or 0
        sums[2] += row["output"] or 0
        sums[3] += float(row["seconds"] or 0)
        cost.add_metric([row["model"], row["currency"]], (row["nanos"] or 0) / 10**9)
    for model, (tokens_in, cached, tokens_out, seconds) in by_model.items():
        for kind, value in (("input", tokens_in), ("cached_input", cached),
                            ("output", tokens_out)):
            tokens.add_metric([model, kind], value)
        engine.add_metric([model], seconds)
    yield tokens
    yield cost
    yield engine


class ServiceCollector:
    """Reads the service's state when Prometheus scrapes."""

    def describe(self) -> list[Metric]:
        # Nothing up front: registering must not query the database.
        return []

    def collect(self) -> Iterator[Metric]:
        batches = GaugeMetricFamily("batchweb_batches", "Batches by status.",
                                    labels=["status"])
        counts = dict(Batch.objects.order_by().values_list("status").annotate(n=Count("id")))
        for status in Batch.Status.values:
            batches.add_metric([status], counts.get(status, 0))
        yield batches

        health = queue_health()
        up = GaugeMetricFamily("batchweb_redis_up", "1 if Redis answered the scrape.")
        up.add_metric([], 1 if health.redis_ok else 0)
        yield up
        depth = GaugeMetricFamily("batchweb_queue_depth", "Jobs waiting in an RQ queue.",
                                  labels=["queue", "model", "priority"])
        workers = GaugeMetricFamily("batchweb_workers", "Live batchworkers serving a model.",
                                    labels=["model"])
        stuck = GaugeMetricFamily("batchweb_shards_stuck",
                                  "Running shards whose heartbeat is stale.", labels=["model"])
        blocked = GaugeMetricFamily(
            "batchweb_model_blocked",
            "1 when a model has work waiting and nothing can run it (no live worker, or "
            "Redis unreachable).", labels=["model"])
        if health.redis_ok:
            depth.add_metric([queues.CONTROL_QUEUE, "", "control"], health.control_depth)
        for model_health in health.models:
            for priority, count in model_health.depth.items():
                queue_name = queues.shard_queue_name(model_health.model, priority)
                depth.add_metric([queue_name, model_health.model, priority], count)
            workers.add_metric([model_health.model], len(model_health.workers))
            stuck.add_metric([model_health.model], len(model_health.stuck))
            can_run = health.redis_ok and not model_health.blocked
            blocked.add_metric([model_health.model], 0 if can_run or not model_health.has_work
                               else 1)
        yield depth
        yield workers
        yield stuck
        yield blocked
        total_workers = GaugeMetricFamily("batchweb_workers_total", "Live RQ workers.")
        if health.redis_ok:
            total_workers.add_metric([], sum(len(h.live) for h in health.hosts))
        yield total_workers
        yield from host_metrics(health)
        yield from remote_metrics(health)

        in_flight = GaugeMetricFamily("batchweb_shards_in_flight",
                                      "Shards queued or running.", labels=["model", "state"])
        for (model, state), n in sorted(shard_counts_by_model().items()):
            in_flight.add_metric([model, state], n)
        yield in_flight

        done = Shard.objects.filter(status=Shard.Status.DONE)
        requests = CounterMetricFamily("batchweb_requests_processed",
                                       "Requests of finished shards.",
                                       labels=["model", "outcome"])
        tokens = CounterMetricFamily("batchweb_tokens_processed",
                                     "Tokens of successful requests.", labels=["model", "kind"])
        for row in done.values(model=F("batch__model")).annotate(
                completed=Sum("completed"), failed=Sum("failed"), input=Sum("input_tokens"),
                output=Sum("output_tokens")).order_by("model"):
            requests.add_metric([row["model"], "completed"], row["completed"] or 0)
            requests.add_metric([row["model"], "failed"], row["failed"] or 0)
            tokens.add_metric([row["model"], "input"], row["input"] or 0)
            tokens.add_metric([row["model"], "output"], row["output"] or 0)
        yield requests
        yield tokens
        yield from _usage_metrics()

        throughput = GaugeMetricFamily(
            "batchweb_throughput_requests_per_second",
            "Requests of shards finished in the last 5 minutes, per second.", labels=["model"])
        recent = done.filter(finished_at__gte=timezone.now() - THROUGHPUT_WINDOW).values(
            model=F("batch__model")).annotate(n=Sum(F("completed") + F("failed")))
        per_model = {row["model"]: row["n"] or 0 for row in recent}
        for model in sorted({m.model for m in health.models} | set(per_model)):
            throughput.add_metric([model], per_model.get(model, 0)
                                  / THROUGHPUT_WINDOW.total_seconds())
        yield throughput

        events = GaugeMetricFamily("batchweb_webhook_events",
                                   "Webhook events by delivery status.", labels=["status"])
        event_counts = dict(WebhookEvent.objects.order_by().values_list("status").annotate(
            n=Count("id")))
        for status in WebhookEvent.Status.values:
            events.add_metric([status], event_counts.get(status, 0))
        yield events
        yield from eval_metrics()
        yield from capacity_metrics(health)


def host_metrics(health: Health) -> Iterator[Metric]:
    """Workers per host: a lost host is one whose registered workers all went silent (they
    stay registered in Redis for minutes after the machine died)."""
    up = GaugeMetricFamily("batchweb_host_up",
                           "1 if a worker of the host sent a heartbeat within "
                           "HEARTBEAT_TIMEOUT_SECONDS, 0 if all its workers are lost.",
                           labels=["host"])
    workers = GaugeMetricFamily("batchweb_host_workers",
                                "Registered workers per host, model and state (lost: no "
                                "heartbeat within HEARTBEAT_TIMEOUT_SECONDS).",
                                labels=["host", "model", "state"])
    held = GaugeMetricFamily("batchweb_host_shards_held",
                             "Running shards held by the host's workers.", labels=["host"])
    age = GaugeMetricFamily("batchweb_host_heartbeat_age_seconds",
                            "Seconds since the newest heartbeat of the host's workers.",
                            labels=["host"])
    for host in health.hosts:
        up.add_metric([host.hostname], 0 if host.lost else 1)
        counts: dict[tuple[str, str], int] = {}
        for worker in host.workers:
            key = (worker.model, worker.status)
            counts[key] = counts.get(key, 0) + 1
        for (model, state), n in sorted(counts.items()):
            workers.add_metric([host.hostname, model, state], n)
        held.add_metric([host.hostname], host.shards_held)
        if host.heartbeat_age is not None:
            age.add_metric([host.hostname], host.heartbeat_age.total_seconds())
    yield up
    yield workers
    yield held
    yield age


def remote_metrics(health: Health) -> Iterator[Metric]:
    """Per remote server (engine/remote_limits.py): what every worker pointing at it holds
    there, the adaptive limit, and what the server made us wait for or fail."""
    labels = ["server"]
    in_flight = GaugeMetricFamily("batchweb_remote_in_flight",
                                  "Requests in flight on a remote server, all workers.",
                                  labels=labels)
    limit = GaugeMetricFamily("batchweb_remote_limit",
                              "The adaptive concurrency limit of a remote server.",
                              labels=labels)
    ceiling = GaugeMetricFamily("batchweb_remote_ceiling",
                                "The configured most requests in flight on a remote server.",
                                labels=labels)
    condition = GaugeMetricFamily("batchweb_remote_condition",
                                  "1 for the server's condition (ok, busy, unreachable).",
                                  labels=["server", "condition"])
    backoffs = CounterMetricFamily("batchweb_remote_backoffs",
                                   "Retries waited for (429, 503, timeouts, resets, no "
                                   "connection).", labels=labels)
    errors = CounterMetricFamily("batchweb_remote_errors",
                                 "Requests that ended failed with a remote server's error.",
                                 labels=labels)
    reason = GaugeMetricFamily("batchweb_remote_limit_reason",
                               "1 for why a remote server's limit is where it is "
                               "(deadline_floor: its SLO traded for a batch's window; "
                               "paused: 0, even one batch request breaks the SLO while "
                               "online users are there).",
                               labels=["server", "reason"])
    slo = GaugeMetricFamily("batchweb_remote_ttft_slo_seconds",
                            "The online time to first token a remote server's limit holds.",
                            labels=labels)
    slo_percentile = GaugeMetricFamily("batchweb_remote_ttft_slo_percentile",
                                       "The percentile the SLO is held at.", labels=labels)
    online = GaugeMetricFamily("batchweb_remote_online_ttft_seconds",
                               "Online users' time to first token lately, at the SLO's "
                               "percentile.", labels=labels)
    samples = GaugeMetricFamily("batchweb_remote_online_ttft_samples",
                                "Online samples that figure holds, by its measure.",
                                labels=["server", "measure"])
    alone = GaugeMetricFamily("batchweb_remote_alone_ttft_seconds",
                              "The same with no batch request in flight.", labels=labels)
    floor = GaugeMetricFamily("batchweb_remote_deadline_floor",
                              "Requests in flight a remote server's batches need for their "
                              "windows.", labels=labels)
    for server in health.servers:
        state = server.state
        for name in REASONS:
            reason.add_metric([state.base_url, name], 1 if state.reason == name else 0)
        floor.add_metric([state.base_url], state.floor)
        for family, value in ((slo, state.slo_ms), (online, state.online_ms),
                              (alone, state.alone_ms)):
            if value is not None:
                family.add_metric([state.base_url], value / 1000)
        if state.slo_percentile is not None:
            slo_percentile.add_metric([state.base_url], state.slo_percentile)
        if state.slo_samples is not None:
            samples.add_metric([state.base_url, state.slo_measure], state.slo_samples)
        in_flight.add_metric([state.base_url], state.in_flight)
        limit.add_metric([state.base_url], state.limit)
        ceiling.add_metric([state.base_url], server.ceiling)
        for name in ("ok", "busy", "unreachable"):
            condition.add_metric([state.base_url, name], 1 if state.condition == name else 0)
        backoffs.add_metric([state.base_url], state.backoffs)
        errors.add_metric([state.base_url], state.errors)
    yield from (in_flight, limit, ceiling, condition, backoffs, errors, reason, slo,
                slo_percentile, online, samples, alone, floor)


def capacity_metrics(health: Health) -> Iterator[Metric]:
    """The capacity plan (jobs.capacity.plan): what an autoscaler scales on."""
    needed = GaugeMetricFamily(
        "batchweb_workers_needed", "The fewest workers of a model that finish every running "
        "batch inside its window (less the capacity margin); 0 when none is left to run.",
        labels=["model"])
    at_risk = GaugeMetricFamily("batchweb_batches_at_risk", "Running batches projected to "
                                "end past their window on the workers alive now.",
                                labels=["model"])
    rates = GaugeMetricFamily("batchweb_worker_tokens_per_second", "A live worker's tokens "
                              "per second while busy (kind: prompt | output).",
                              labels=["model", "worker", "kind"])
    planned = {m.model: m.plan for m in health.models}
    for model in sorted({*model_names(), *planned}):
        plan = planned.get(model)
        needed.add_metric([model], plan.workers_needed if plan else 0)
        at_risk.add_metric([model], sum(p.at_risk for p in plan.batches) if plan else 0)
        for worker in plan.workers if plan else live_workers(model):
            rates.add_metric([model, worker.name, "prompt"], worker.prompt_tokens_per_second)
            rates.add_metric([model, worker.name, "output"], worker.output_tokens_per_second)
    yield from (needed, at_risk, rates)


def render_metrics() -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServiceCollector())
    return generate_latest(registry)


def _allowed(request: HttpRequest) -> bool:
    token: str = settings.BATCHWEB["METRICS_TOKEN"]
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if token and scheme.lower() == "bearer" and hmac.compare_digest(
            given.strip().encode(), token.encode()):
        return True
    user: Any = getattr(request, "user", None)
    return bool(user is not None and user.is_authenticated and user.is_staff)


@require_GET
def metrics_view(request: HttpRequest) -> HttpResponse:
    if not _allowed(request):
        response = HttpResponse("Send 'Authorization: Bearer <metrics token>' or sign in as "
                                "staff.\n", status=401, content_type="text/plain")
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    return HttpResponse(render_metrics(), content_type=CONTENT_TYPE_LATEST)


# Eval sets are users' data: their series are labelled by the set's id as the API shows it
# (unique, where two owners' sets may share a name), and only for the sets of runs whose
# batch is active or that started or were scored within EVAL_WINDOW, the newest
# EVAL_SETS_SHOWN of them, so the series a scrape holds stay few whatever users create.
EVAL_WINDOW = timedelta(hours=24)
EVAL_SETS_SHOWN = 100


def eval_metrics() -> Iterator[Metric]:
    """Drift: the batches flagged, and the shown sets' runs and newest score on each
    model."""
    from jobs.models import EvalRun, EvalSet
    from jobs.services.evals import public_id

    drift = GaugeMetricFamily("batchweb_batches_eval_drift",
                              "Batches an eval run scored below its baseline.")
    drift.add_metric([], Batch.objects.filter(eval_drift=True).count())
    yield drift
    since = timezone.now() - EVAL_WINDOW
    lately = EvalRun.objects.filter(Q(batch__status__in=Batch.ACTIVE) | Q(created_at__gte=since)
                                    | Q(scored_at__gte=since))
    newest = (lately.values("eval_set_id").annotate(newest=Max("created_at"))
              .order_by("-newest").values_list("eval_set_id", flat=True)[:EVAL_SETS_SHOWN])
    shown = {pk: public_id(eval_set) for pk, eval_set in
             EvalSet.objects.in_bulk(list(newest)).items()}
    runs = GaugeMetricFamily("batchweb_eval_runs",
                             f"Eval runs by set id, model and status: those whose batch is "
                             f"active or that started or were scored in the last "
                             f"{EVAL_WINDOW.total_seconds() / 3600:g} hours.",
                             labels=["eval_set", "model", "status"])
    for set_id, model, status, n in (lately.filter(eval_set_id__in=shown).order_by()
                                     .values_list("eval_set_id", "base_model", "status")
                                     .annotate(n=Count("id"))):
        runs.add_metric([shown[set_id], model, status], n)
    yield runs
    score = GaugeMetricFamily("batchweb_eval_score",
                              "The newest scored eval run's score, by set id and model (the "
                              "sets of batchweb_eval_runs).", labels=["eval_set", "model"])
    seen: set[tuple[int, str]] = set()
    for set_id, model, value in (EvalRun.objects.filter(status=EvalRun.Status.SCORED,
                                                        eval_set_id__in=shown)
                                 .order_by("-scored_at")
                                 .values_list("eval_set_id", "base_model", "score")[:1000]):
        if (set_id, model) not in seen:
            seen.add((set_id, model))
            score.add_metric([shown[set_id], model], value or 0.0)
    yield score
