"""Benchmark 4: the dashboard and the API under load while a batch runs.

A scratch deployment (its own SQLite database, storage and private Redis; or the database
named by --database-url, which must be a scratch one: it is migrated and rows are added):
  - one user with --history ended batches (10 requests each) so lists are not trivially empty,
  - gunicorn as `make run` serves it (manage.py runservice: gthread, 2 workers = one per
    core on this 2-core machine, 8 threads each; threads cover the database waits, the
    processes the GIL), DEBUG off,
  - --batchworkers echo workers running one big batch, slowed down (BATCHWEB_ECHO_SECONDS)
    so that it is still running when the load ends,
then for --seconds:
  - --pollers clients alternately GET the batch page's live partial (what its htmx polls:
    /batches/<id>/live with HX-Request, signed in with a session cookie from the login
    form) and GET /v1/batches/<id> (API key),
  - --listers clients alternately GET /v1/batches?limit=20 and the dashboard's batch list
    partial (/ with HX-Request: the #batch-table partial, 20 rows),
each client waiting --interval seconds after each answer (2 s: the page's own polling
period; 0 = as fast as possible). Reports per endpoint: requests, p50, p99, max, errors
(non-2xx answers or transport errors), and the web server's CPU time per request.

--heavy instead has --heavy-clients clients (the one signed-in user, as from several tabs)
hammer the views that read whole files (--interval 0 unless given): the running batch's
errors tab (error counts; every 4th request of the batch fails) and spot-check tab (the
sample), and the new-batch page's preflight of the batch's stored input file. A 429 ("already
being computed", the per-user guard) is counted as `busy`, not as an error.

    .venv/bin/python bench/dashboard_load.py [--seconds 60] [--pollers 50] [--listers 10]
        [--database-url postgres://postgres@127.0.0.1:5432/batchweb_dashboard_bench]
    .venv/bin/python bench/dashboard_load.py --heavy [--seconds 20] [--heavy-clients 8]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import subprocess
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx

try:
    from bench import harness
except ImportError:  # run as `python bench/dashboard_load.py`: bench/ itself is on the path
    import harness  # type: ignore[no-redef]

percentile = harness.percentile
PASSWORD = "bench-dashboard-pw-1"
ENDPOINTS = {
    "live": "batch page live partial (htmx)",
    "retrieve": "GET /v1/batches/{id}",
    "list_partial": "batch list partial (htmx)",
    "list_api": "GET /v1/batches?limit=20",
}
HEAVY_ENDPOINTS = {
    "errors": "errors tab (error counts)",
    "spot_check": "spot-check tab (sample)",
    "preflight": "preflight of a stored file",
}
# (name, url, headers, form data: POSTed when not None)
Op = tuple[str, str, dict[str, str], dict[str, str] | None]


def login(base: str) -> dict[str, str]:
    """Sign in through the login form, as a browser does; returns the cookies."""
    with httpx.Client(base_url=base, timeout=30) as client:
        page = client.get("/accounts/login/")
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text)
        assert token, page.text[:500]
        response = client.post("/accounts/login/", data={
            "username": "dash", "password": PASSWORD,
            "csrfmiddlewaretoken": token.group(1), "next": "/"})
        assert response.status_code == 302, (response.status_code, response.text[:500])
        cookies = dict(client.cookies.items())
    assert "sessionid" in cookies, cookies
    return cookies


class Stats:
    def __init__(self) -> None:
        self.latency: dict[str, list[float]] = defaultdict(list)
        self.errors: dict[str, int] = defaultdict(int)
        self.busy: dict[str, int] = defaultdict(int)
        self.samples: list[str] = []

    def error(self, op: str, message: str) -> None:
        self.errors[op] += 1
        if len(self.samples) < 10:
            self.samples.append(f"{op}: {message}")


async def client_loop(ops: list[Op], base: str,
                      cookies: dict[str, str], deadline: float, interval: float,
                      stats: Stats, rng: random.Random) -> None:
    limits = httpx.Limits(keepalive_expiry=10)
    async with httpx.AsyncClient(base_url=base, cookies=cookies, timeout=30,
                                 limits=limits) as client:
        if interval:
            await asyncio.sleep(rng.uniform(0, interval))  # spread the clients out
        turn = rng.randrange(len(ops))
        while time.monotonic() < deadline:
            op, url, headers, form = ops[turn % len(ops)]
            turn += 1
            started = time.perf_counter()
            try:
                if form is None:
                    response = await client.get(url, headers=headers)
                else:
                    response = await client.post(url, headers=headers, data=form)
                await response.aread()
            except Exception as exc:  # transport errors and timeouts count as errors
                stats.error(op, f"{type(exc).__name__}: {exc}")
            else:
                stats.latency[op].append(time.perf_counter() - started)
                if response.status_code == 429:
                    stats.busy[op] += 1
                elif not 200 <= response.status_code < 300:
                    stats.error(op, f"{response.status_code} {response.text[:200]!r}")
            if interval:
                pause = interval * rng.uniform(0.9, 1.1)
                await asyncio.sleep(max(0.0, min(pause, deadline - time.monotonic())))


async def warm_up(ops: list[Op], base: str,
                  cookies: dict[str, str], stats: Stats) -> None:
    await asyncio.gather(*(client_loop([op], base, cookies, time.monotonic() + 2, 0, stats,
                                       random.Random(i)) for i, op in enumerate(ops * 4)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--pollers", type=int, default=50)
    parser.add_argument("--listers", type=int, default=10)
    parser.add_argument("--interval", type=float, default=None,
                        help="seconds a client waits after each answer (0: none; default 2, "
                             "0 with --heavy)")
    parser.add_argument("--heavy", action="store_true",
                        help="hammer the heavy views instead (see above)")
    parser.add_argument("--heavy-clients", type=int, default=8)
    parser.add_argument("--history", type=int, default=199,
                        help="ended batches of the user besides the running one")
    parser.add_argument("--batch-requests", type=int, default=2000)
    parser.add_argument("--shard-size", type=int, default=50)
    parser.add_argument("--gunicorn-workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--batchworkers", type=int, default=1)
    parser.add_argument("--database-url", default="",
                        help="a scratch database (default: SQLite in a temporary directory)")
    harness.add_json_option(parser)
    args = parser.parse_args()
    if args.interval is None:
        args.interval = 0.0 if args.heavy else 2.0

    scratch = Path(tempfile.mkdtemp(prefix="bw-dash-bench-"))
    with harness.private_redis(scratch):  # private: no other worker sees the jobs
        measure(args, scratch)
    harness.remove(scratch)


def measure(args: argparse.Namespace, scratch: Path) -> None:
    in_flight = 64
    # Long enough for the batch to outlast setup + load: each worker runs `in_flight`
    # requests at a time, each taking `echo_seconds`.
    run_for = args.seconds * 1.5 + 30
    echo_seconds = round(run_for * args.batchworkers * in_flight / args.batch_requests, 2)
    web_port = harness.free_port()
    env = {**os.environ, "BATCHWEB_VAR_DIR": str(scratch), "DEBUG": "0",
           "DJANGO_SETTINGS_MODULE": "batchweb.settings", "ALLOWED_HOSTS": "127.0.0.1",
           "BATCHWEB_ECHO_MODEL": "1", "BATCHWEB_ECHO_SECONDS": str(echo_seconds),
           "BATCHWEB_ECHO_MAX_IN_FLIGHT": str(in_flight),
           "BATCHWEB_SHARD_SIZE": str(args.shard_size), "BATCHWEB_CLEANUP_INTERVAL_SECONDS": "0",
           "LOG_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1"}
    env.pop("DATABASE_URL", None)
    if args.database_url:
        env["DATABASE_URL"] = args.database_url
    database = args.database_url.split(":")[0] or "sqlite"
    procs: list[subprocess.Popen] = []
    log = open(scratch / "services.log", "wb")  # noqa: SIM115
    try:
        harness.manage(env, "migrate", "--noinput", "-v0")
        started = time.monotonic()
        key = harness.in_deployment(env, "history", str(args.history), "10", PASSWORD)["key"]
        print(f"setup: {args.history} ended batches in {time.monotonic() - started:.0f} s",
              flush=True)
        server = harness.gunicorn(
            web_port, env, "-k", "gthread", "-w", str(args.gunicorn_workers), "--threads",
            str(args.threads), "--timeout", "120", "--keep-alive", "30", stdout=log,
            stderr=subprocess.STDOUT)
        procs.append(server)
        for _ in range(args.batchworkers):
            procs.append(harness.batchworker("echo-test", env, log))
        base = f"http://127.0.0.1:{web_port}"
        harness.wait_http(base + "/accounts/login/")
        api = {"Authorization": f"Bearer {key}"}
        # --heavy: every 4th request asks for more than the echo model's context (2048
        # tokens), so the batch has error lines to count.
        content = harness.jsonl([harness.chat_request(
            f"run-{i}", f"question number {i}",
            max_tokens=4000 if args.heavy and i % 4 == 0 else 16)
            for i in range(args.batch_requests)])
        file = httpx.post(base + "/v1/files", headers=api, timeout=60, data={"purpose": "batch"},
                          files={"file": ("run.jsonl", content)}).json()
        batch = httpx.post(base + "/v1/batches", headers=api, timeout=60, json={
            "input_file_id": file["id"], "endpoint": "/v1/chat/completions",
            "completion_window": "24h"}).json()
        batch_id = batch["id"]
        deadline = time.monotonic() + 60
        while batch["status"] == "validating" and time.monotonic() < deadline:
            time.sleep(0.2)
            batch = httpx.get(f"{base}/v1/batches/{batch_id}", headers=api).json()
        assert batch["status"] == "in_progress", batch
        cookies = login(base)
        htmx = {"HX-Request": "true"}
        pollers: list[Op] = [("live", f"/batches/{batch_id}/live", htmx, None),
                             ("retrieve", f"/v1/batches/{batch_id}", api, None)]
        listers: list[Op] = [("list_api", "/v1/batches?limit=20", api, None),
                             ("list_partial", "/", htmx, None)]
        heavy: list[Op] = [
            ("errors", f"/batches/{batch_id}/errors", {}, None),
            ("spot_check", f"/batches/{batch_id}/spot-check", {}, None),
            ("preflight", "/batches/new", {"X-CSRFToken": cookies["csrftoken"]},
             {"file_id": file["id"], "action": "check", "completion_window": "24h",
              "priority": "default"})]
        if args.heavy:
            # Let a few shards finish first, so the tabs have results to read.
            time.sleep(min(10.0, args.seconds / 2))
            groups = [(heavy, args.heavy_clients)]
            clients = f"{args.heavy_clients} clients on the heavy views"
        else:
            groups = [(pollers, args.pollers), (listers, args.listers)]
            clients = f"{args.pollers} pollers + {args.listers} listers"
        print(f"load: {clients}, every "
              f"{args.interval:g} s, for {args.seconds:g} s against gunicorn "
              f"{args.gunicorn_workers}x{args.threads} threads ({database}); batch {batch_id} "
              f"of {args.batch_requests} requests in shards of {args.shard_size} on "
              f"{args.batchworkers} echo worker(s) at {echo_seconds} s/request", flush=True)

        # Warm up (not counted): each gunicorn process imports views and compiles
        # templates on its first requests.
        warm = Stats()
        asyncio.run(warm_up([op for ops, _ in groups for op in ops], base, cookies, warm))
        stats = Stats()
        cpu_before = harness.cpu_seconds(server.pid)

        async def run() -> None:
            end = time.monotonic() + args.seconds
            await asyncio.gather(*(
                client_loop(ops, base, cookies, end, args.interval, stats,
                            random.Random(1000 * g + i))
                for g, (ops, count) in enumerate(groups) for i in range(count)))

        load_started = time.monotonic()
        asyncio.run(run())
        elapsed = time.monotonic() - load_started
        cpu = harness.cpu_seconds(server.pid) - cpu_before
        after = httpx.get(f"{base}/v1/batches/{batch_id}", headers=api).json()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                # Scratch deployment: the workers' shards in flight need not be handed back.
                proc.wait(timeout=60 if proc is procs[0] else 3)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()

    rows = []
    every: list[float] = []
    for op, label in (HEAVY_ENDPOINTS if args.heavy else ENDPOINTS).items():
        values = stats.latency[op]
        every += values
        rows.append((label, len(values) + stats.errors[op], values, stats.errors[op],
                     stats.busy[op]))
    rows.append(("all", len(every) + sum(stats.errors.values()), every,
                 sum(stats.errors.values()), sum(stats.busy.values())))
    print(f"\n{'endpoint':<32} {'requests':>8} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7} "
          f"{'errors':>6} {'busy':>6}")
    report: dict[str, Any] = {"seconds": round(elapsed, 1), "pollers": args.pollers,
                              "listers": args.listers, "interval": args.interval,
                              "gunicorn": f"{args.gunicorn_workers}x{args.threads}",
                              "database": database, "endpoints": {}}
    if args.heavy:
        report.update(mode="heavy", heavy_clients=args.heavy_clients)
    for label, count, values, errors, busy in rows:
        p50, p99 = percentile(values, 0.5) * 1000, percentile(values, 0.99) * 1000
        top = max(values, default=0) * 1000
        print(f"{label:<32} {count:>8} {p50:>7.1f} {p99:>7.1f} {top:>7.1f} {errors:>6} "
              f"{busy:>6}")
        report["endpoints"][label] = {"requests": count, "p50_ms": round(p50, 1),
                                      "p99_ms": round(p99, 1), "max_ms": round(top, 1),
                                      "errors": errors, "busy": busy}
    total = rows[-1][1]
    print(f"{total / elapsed:.1f} requests/s; web server CPU {cpu:.1f} s "
          f"({1000 * cpu / max(total, 1):.1f} ms a request)")
    progress = after["request_counts"]
    print(f"batch at the end: {after['status']}, {progress['completed']}/{progress['total']}")
    if after["status"] != "in_progress":
        print("WARNING: the batch ended before the load did (raise --batch-requests)")
    for sample in stats.samples:
        print("  ", sample)
    met = rows[-1][3] == 0 and percentile(every, 0.99) < 0.1
    print(f"targets (p99 < 100 ms, zero errors): {'met' if met else 'NOT met'}")
    report.update(requests_per_second=round(total / elapsed, 1), web_cpu_seconds=round(cpu, 1),
                  batch_at_end=after["status"], targets_met=met)
    harness.write_json(args.json, report)


if __name__ == "__main__":
    harness.run(main)
