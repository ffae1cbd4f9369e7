"""The usage ledger's reads over a year of a busy service: 1M UsageRecord rows on
PostgreSQL (a finished shard each: 100 users, one of them a fifth of the rows, 300 API
keys, 12 models; each user runs 1 to 4 workloads, a (key, model, endpoint) each, the
busiest 8; spread over 365 days) and their daily sums (UsageDay, as the ledger writes
them), then each read the service makes, timed through the code that makes it
(jobs.queries.usage, the budget check, /metrics): the median of --runs after one warm-up.

    .venv/bin/python bench/usage_ledger.py [--rows 1000000] [--runs 7]
        [--server postgres://postgres@127.0.0.1:5432]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from datetime import UTC, datetime, timedelta

try:
    from bench import harness
except ImportError:  # run as `python bench/usage_ledger.py`
    import harness  # type: ignore[no-redef]

DATABASE = "batchweb_usage_bench"
MODELS = [f"model-{i}" for i in range(10)] + ["adapter-a", "adapter-b"]
ENDPOINTS = ["/v1/chat/completions"] * 6 + ["/v1/responses", "/v1/embeddings"]


def load(url: str, rows: int, now: datetime) -> None:
    """Users, keys and `rows` ledger rows, written with COPY."""
    with harness.pg_connect(url) as db:
        db.execute("INSERT INTO auth_user (password, is_superuser, username, first_name, "
                   "last_name, email, is_staff, is_active, date_joined) SELECT '', false, "
                   "'u' || i, '', '', '', false, true, now() FROM generate_series(1, 100) i")
        users = [r[0] for r in db.execute("SELECT id FROM auth_user ORDER BY id")]
        db.execute("INSERT INTO jobs_apikey (owner_id, name, prefix, secret_hash, created_at) "
                   "SELECT (SELECT id FROM auth_user ORDER BY id OFFSET (i % 100) LIMIT 1), "
                   "'k' || i, 'p' || i, md5(i::text), now() FROM generate_series(1, 300) i")
        keys: dict[int, list[int | None]] = {}
        for key, owner in db.execute("SELECT id, owner_id FROM jobs_apikey"):
            keys.setdefault(owner, [None]).append(key)
        rng = random.Random(43)
        workloads = {owner: [(rng.choice(keys[owner]), model,
                              "/v1/embeddings" if model == "model-9" else rng.choice(ENDPOINTS))
                             for model in rng.sample(MODELS, 8 if owner == users[0]
                                                     else rng.randint(1, 4))]
                     for owner in users}
        columns = ("owner_id, api_key_id, batch_id, shard_id, model, base_model, endpoint, "
                   "requests_succeeded, requests_failed, input_tokens, cached_tokens, "
                   "output_tokens, reasoning_tokens, cost_nanos, currency, input_price, "
                   "cached_price, output_price, engine_seconds, eval_run, recorded_at")
        year = 365 * 86400
        with db.cursor().copy(f"COPY jobs_usagerecord ({columns}) FROM STDIN") as copy:
            for i in range(rows):
                owner = users[0] if rng.random() < 0.2 else rng.choice(users)
                key, model, endpoint = rng.choice(workloads[owner])
                tokens_in = rng.randint(10_000, 2_000_000)
                cached = tokens_in // rng.randint(2, 10)
                tokens_out = rng.randint(1_000, 500_000)
                copy.write_row((
                    owner, key, f"batch_{i // 20:024x}", f"shard_{i:024x}", model,
                    model if model.startswith("model") else "model-0", endpoint,
                    rng.randint(100, 1000), rng.randint(0, 5), tokens_in, cached, tokens_out,
                    0, (tokens_in + 4 * tokens_out) * 1000, "usd", 1, 0.5, 4,
                    rng.uniform(1, 300), False,
                    now - timedelta(seconds=rng.randint(0, year))))
        # The daily sums, as jobs.services.ledger.add_to_days adds each row to them.
        sums = ("requests_succeeded, requests_failed, input_tokens, cached_tokens, "
                "output_tokens, reasoning_tokens, cost_nanos, engine_seconds")
        db.execute(f"INSERT INTO jobs_usageday (day, owner_id, api_key_id, model, endpoint, "
                   f"currency, eval_run, {sums}) SELECT (recorded_at AT TIME ZONE 'UTC')::date, "
                   f"owner_id, coalesce(api_key_id, 0), model, endpoint, currency, eval_run, "
                   + ", ".join(f"sum({c})" for c in sums.split(", "))
                   + " FROM jobs_usagerecord GROUP BY 1, 2, 3, 4, 5, 6, 7")
        db.execute("ANALYZE jobs_usagerecord")
        db.execute("ANALYZE jobs_usageday")
        print("daily sums:", db.execute("SELECT count(*) FROM jobs_usageday").fetchone()[0],
              "rows", flush=True)


def timed(runs: int, read: object) -> float:
    assert callable(read)
    read()  # warm-up: the plan cached, the pages in memory
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        read()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--server", default="postgres://postgres@127.0.0.1:5432")
    parser.add_argument("--keep", action="store_true",
                        help=f"keep the database ({DATABASE}) to look at the plans")
    harness.add_json_option(parser)
    args = parser.parse_args()
    url = f"{args.server}/{DATABASE}"
    harness.create_database(args.server, DATABASE)
    try:
        env = {**os.environ, "DATABASE_URL": url, "LOG_LEVEL": "WARNING"}
        harness.manage(env, "migrate", "-v0")
        now = datetime.now(UTC)
        started = time.monotonic()
        load(url, args.rows, now)
        print(f"loaded {args.rows:,} rows in {time.monotonic() - started:.0f} s", flush=True)
        results = measure(url, args.runs, now)
    finally:
        if not args.keep:
            harness.drop_database(args.server, DATABASE)
    width = max(len(name) for name in results)
    for name, ms in results.items():
        print(f"{name:<{width}}  {ms:7.1f} ms")
    harness.write_json(args.json, {"rows": args.rows, "runs": args.runs, "ms": results})


def measure(url: str, runs: int, now: datetime) -> dict[str, float]:
    os.environ["DATABASE_URL"] = url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "batchweb.settings")
    import django

    django.setup()
    from django.contrib.auth import get_user_model

    from jobs.api.usage import KINDS
    from jobs.http.metrics import _usage_metrics
    from jobs.queries import usage
    from jobs.services.quotas import cost_nanos_since, period_starts

    busy = get_user_model().objects.order_by("id").first()
    assert busy is not None
    month, year = usage.day_range(30, now=now), usage.day_range(365, now=now)

    def page(days: tuple[datetime, datetime], owner: int | None, groups: list[str]
             ) -> object:
        filters = usage.Filters(owner_id=owner, start=days[0], end=days[1])
        return lambda: usage.bucketed(filters, bucket_width="1d", group_by=groups)

    return {
        "Usage page, busiest user, 30 days by day and model":
            timed(runs, page(month, busy.pk, ["model", "currency"])),
        "Usage page, busiest user, 365 days by day and model":
            timed(runs, page(year, busy.pk, ["model", "currency"])),
        "completions usage API, busiest user, 365 days by day and key": timed(runs, lambda: (
            usage.bucketed(usage.Filters(owner_id=busy.pk, start=year[0], end=year[1],
                                         endpoints=KINDS["completions"]), bucket_width="1d",
                           group_by=["api_key_id"]))),
        "costs API, staff (every user), 30 days by day and model":
            timed(runs, page(month, None, ["currency", "model"])),
        "costs API, staff (every user), 365 days by day":
            timed(runs, page(year, None, ["currency"])),
        "budget check, busiest user's month": timed(runs, lambda: cost_nanos_since(
            busy, period_starts(now)[1])),
        "batch page cost (one batch)": timed(runs, lambda: usage.batch_cost(
            "batch_" + "0" * 23 + "1")),
        "/metrics, the whole ledger by model": timed(runs, lambda: list(_usage_metrics())),
    }


if __name__ == "__main__":
    harness.run(main)
