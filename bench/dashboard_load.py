"""Benchmark 4: the dashboard and the API under load while a batch runs.

A scratch deployment (its own SQLite database, storage and private Redis; or the PostgreSQL
database named by --database-url, which is dropped if it exists and made anew):
  - one user with --history ended batches (10 requests each) so lists are not trivially empty,
  - Granian as `make run` serves it (manage.py runservice: 2 worker processes = one per
    core on this 2-core machine, 8 blocking threads each; threads cover the database waits,
    the processes the GIL; no access log), DEBUG off, through bench.timed_wsgi, which
    reports what each request cost inside the application (CPU, database time, queries,
    whether the poll memo answered) in a Server-Timing header; `--server gunicorn` runs
    gunicorn's gthread worker instead (2 x 8), the service's server before Granian,
  - --batchworkers echo workers running one big batch, slowed down (BATCHWEB_ECHO_SECONDS)
    so that its counts change every --change-seconds (10 s: a shard of 50 requests ends; the
    worker's heartbeat, every 5 s, also writes its progress) and it is still running when
    the load ends; so some polls find the batch changed and others not,
then for --seconds, the dashboard shape (the default):
  - --pollers clients alternately GET the batch page's live partial and GET
    /v1/batches/<id> (API key). The live partial is polled as a browser does (htmx, signed in
    with a session cookie from the login form): it sends back the ETag of the copy it holds
    (If-None-Match) and follows the polling URL of each new copy. GET /v1/batches/<id> is
    polled as the `openai` client does, with no If-None-Match, by the even-numbered pollers,
    and revalidating like a browser by the odd-numbered ones,
  - --listers clients alternately GET /v1/batches?limit=20 and the dashboard's batch list
    partial (/ with HX-Request: the #batch-table partial, 20 rows),
each client waiting --interval seconds after each answer (2 s: the fastest polling period of
the page; browsers stretch it to 30 s while the batch does not change, which only lowers the
load; 0 = as fast as possible).

--api-clients N is the API shape instead: N `openai`-like clients (no If-None-Match, each with
a connection of its own), each polling GET /v1/batches/<id> of the running batch every
--interval seconds (10 s by default then), sharing --keys API keys of the batch's owner (1 by
default: the poll memo then answers them all from one remembered answer; with a key each,
each client's first poll after a change goes through Django).

Reports the offered load (requests sent a second, and what the clients would send if every
answer were instant), then per endpoint: requests, p50, p99, max, errors (non-2xx/304 answers
or transport errors), and, for the polls, the same split into unchanged answers (a 304, or a
200 with the ETag the client already had) and changed ones (the batch changed since the
client's previous poll); and the web server's CPU time: in Django per request (from
Server-Timing), and the processes' total per request, the difference being the server's own
(reading, parsing, writing, its event loop), shared evenly over the requests.

--heavy instead has --heavy-clients clients (the one signed-in user, as from several tabs)
hammer the views that read whole files (--interval 0 unless given): the running batch's
errors tab (error counts; every 4th request of the batch fails) and spot-check tab (the
sample), and the new-batch page's preflight of the batch's stored input file. A 429 ("already
being computed", the per-user guard) is counted as `busy`, not as an error.

    BATCHWEB_HTTPS=0 .venv/bin/python bench/dashboard_load.py [--seconds 60] [--pollers 50]
        [--listers 10] [--database-url postgres://postgres@127.0.0.1:5432/batchweb_dash_bench]
    BATCHWEB_HTTPS=0 .venv/bin/python bench/dashboard_load.py --api-clients 500 [--seconds 60]
    BATCHWEB_HTTPS=0 .venv/bin/python bench/dashboard_load.py --heavy [--seconds 20]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import re
import ssl
import subprocess
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
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
    "retrieve": "GET /v1/batches/{id} (openai)",
    "retrieve_revalidating": "GET /v1/batches/{id} (revalidating)",
    "list_partial": "batch list partial (htmx)",
    "list_api": "GET /v1/batches?limit=20",
}
API_ENDPOINTS = {"retrieve": "GET /v1/batches/{id} (openai)"}
HEAVY_ENDPOINTS = {
    "errors": "errors tab (error counts)",
    "spot_check": "spot-check tab (sample)",
    "preflight": "preflight of a stored file",
}
POLLS = ("live", "retrieve", "retrieve_revalidating")
# The targets of the dashboard shape, per endpoint, and of the API shape.
P50_TARGET_MS, P99_TARGET_MS = 10.0, 100.0
API_P99_TARGET_MS = 200.0
UNCHANGED_CPU_TARGET_MS, CHANGED_CPU_TARGET_MS = 1.0, 3.0
POLL_URL = re.compile(r'hx-get="([^"]*)"')
POLL_VERSION = re.compile(r'data-poll-version="([^"]*)"')
TIMING = re.compile(r"(\w+)(?:;dur=([0-9.]+))?(?:;desc=\"(\d+)\")?")


@dataclass
class Op:
    name: str
    url: str
    headers: dict[str, str]
    form: dict[str, str] | None = None  # POSTed when not None
    revalidate: bool = False  # send back the ETag of the copy held (If-None-Match)
    follow: bool = False  # poll next the URL of the copy's hx-get, as htmx does


@dataclass
class Sample:
    op: str
    at: float  # seconds into the load
    latency: float
    status: int
    kind: str  # "changed", "unchanged", "first" (a poll with nothing to compare) or ""
    app_ms: float = 0.0  # from Server-Timing: time in Django, its thread's CPU, db time
    cpu_ms: float = 0.0
    db_ms: float = 0.0
    queries: int = 0
    remembered: int = 0  # 1: answered from the poll memo (jobs.http.polls), before Django


@dataclass
class Stats:
    samples: list[Sample] = field(default_factory=list)
    sent: int = 0
    errors: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    busy: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    messages: list[str] = field(default_factory=list)

    def error(self, op: str, message: str) -> None:
        self.errors[op] += 1
        if len(self.messages) < 10:
            self.messages.append(f"{op}: {message}")


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


def server_timing(response: httpx.Response, sample: Sample) -> None:
    for name, value, desc in TIMING.findall(response.headers.get("Server-Timing", "")):
        if name == "app":
            sample.app_ms = float(value)
        elif name == "cpu":
            sample.cpu_ms = float(value)
        elif name == "db":
            sample.db_ms, sample.queries = float(value), int(desc or 0)
        elif name == "memo":
            sample.remembered = int(desc or 0)


# One TLS context for every client (none is used over plain HTTP, but each httpx client would
# otherwise build its own, which costs the load generator a noticeable CPU time).
_SSL = ssl.create_default_context()


async def client_loop(ops: list[Op], base: str, cookies: dict[str, str], started: float,
                      deadline: float, interval: float, stats: Stats, rng: random.Random,
                      spread: float | None = None) -> None:
    limits = httpx.Limits(keepalive_expiry=60)
    # The ETag of the copy held of each URL (a browser's cache is by URL).
    etags: dict[str, str] = {}
    versions: dict[str, str] = {}  # op -> the batch's version in that answer
    urls = {op.name: op.url for op in ops}
    async with httpx.AsyncClient(base_url=base, cookies=cookies, timeout=30, limits=limits,
                                 verify=_SSL) as client:
        if interval or spread:
            await asyncio.sleep(rng.uniform(0, spread or interval))  # spread the clients out
        turn = rng.randrange(len(ops))
        while time.monotonic() < deadline:
            op = ops[turn % len(ops)]
            turn += 1
            url = urls[op.name]
            headers = dict(op.headers)
            if op.revalidate and url in etags:
                headers["If-None-Match"] = etags[url]
            stats.sent += 1
            begun = time.perf_counter()
            try:
                if op.form is None:
                    response = await client.get(url, headers=headers)
                else:
                    response = await client.post(url, headers=headers, data=op.form)
                await response.aread()
            except Exception as exc:  # transport errors and timeouts count as errors
                stats.error(op.name, f"{type(exc).__name__}: {exc}")
            else:
                latency = time.perf_counter() - begun
                status = response.status_code
                kind = ""
                if op.name in POLLS and status in (200, 286, 304):
                    # What the client holds of the batch: the answer's ETag, or for the
                    # live block the version it shows (its ETag also changes each minute,
                    # with the block's time-derived figures).
                    etag = response.headers.get("ETag", "")
                    seen = etag
                    if op.follow and status != 304:
                        found = POLL_URL.search(response.text)
                        if found:
                            urls[op.name] = found[1].replace("&amp;", "&")
                        version = POLL_VERSION.search(response.text)
                        seen = version[1] if version else ""
                    if status == 304 or (seen and versions.get(op.name) == seen):
                        kind = "unchanged"
                    else:
                        kind = "changed" if op.name in versions else "first"
                    if status != 304 and etag:
                        etags[url] = etag
                        versions[op.name] = seen
                sample = Sample(op.name, begun - started, latency, status, kind)
                server_timing(response, sample)
                stats.samples.append(sample)
                if status == 429:
                    stats.busy[op.name] += 1
                elif not (200 <= status < 300 or status == 304):
                    stats.error(op.name, f"{status} {response.text[:200]!r}")
            if interval:
                pause = interval * rng.uniform(0.9, 1.1)
                await asyncio.sleep(max(0.0, min(pause, deadline - time.monotonic())))


async def warm_up(ops: list[Op], base: str, cookies: dict[str, str]) -> None:
    now = time.monotonic()
    await asyncio.gather(*(client_loop([op], base, cookies, now, now + 2, 0, Stats(),
                                       random.Random(i)) for i, op in enumerate(ops * 4)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--pollers", type=int, default=50)
    parser.add_argument("--listers", type=int, default=10)
    parser.add_argument("--api-clients", type=int, default=0,
                        help="the API shape instead: this many clients polling the batch")
    parser.add_argument("--keys", type=int, default=1,
                        help="API keys the --api-clients share (each client uses one; one "
                             "per client: --keys N for N clients)")
    parser.add_argument("--interval", type=float, default=None,
                        help="seconds a client waits after each answer (0: none; default 2, "
                             "10 with --api-clients, 0 with --heavy)")
    parser.add_argument("--heavy", action="store_true",
                        help="hammer the heavy views instead (see above)")
    parser.add_argument("--heavy-clients", type=int, default=8)
    parser.add_argument("--history", type=int, default=199,
                        help="ended batches of the user besides the running one")
    parser.add_argument("--batch-requests", type=int, default=2000,
                        help="requests of the running batch (raised to outlast the load)")
    parser.add_argument("--change-seconds", type=float, default=10.0,
                        help="how often the running batch's counts change (a shard ends)")
    parser.add_argument("--shard-size", type=int, default=50)
    parser.add_argument("--server", choices=("granian", "gunicorn"), default="granian",
                        help="the web server (granian, the service's; gunicorn to compare, "
                             "from the test extra)")
    parser.add_argument("--web-workers", "--gunicorn-workers", dest="web_workers", type=int,
                        default=2, help="web server processes")
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--server-args", default="",
                        help="more arguments for the web server, as one string (tuning)")
    parser.add_argument("--batchworkers", type=int, default=1)
    parser.add_argument("--database-url", default="",
                        help="a scratch PostgreSQL database, dropped and made anew "
                        "(default: SQLite in a temporary directory)")
    harness.add_json_option(parser)
    args = parser.parse_args()
    if args.interval is None:
        args.interval = 0.0 if args.heavy else 10.0 if args.api_clients else 2.0

    scratch = Path(tempfile.mkdtemp(prefix="bw-dash-bench-"))
    with harness.private_redis(scratch):  # private: no other worker sees the jobs
        measure(args, scratch)
    harness.remove(scratch)


def measure(args: argparse.Namespace, scratch: Path) -> None:
    # A worker runs a whole shard at once, each request taking --change-seconds: the batch's
    # counts change once a shard ends, every --change-seconds (with the worker's heartbeat,
    # every 5 s, in between), and it outlasts setup + load.
    in_flight = args.shard_size
    echo_seconds = args.change_seconds
    run_for = args.seconds * 1.5 + 30
    shards = math.ceil(run_for / echo_seconds) * args.batchworkers
    args.batch_requests = max(args.batch_requests, shards * args.shard_size)
    web_port = harness.free_port()
    env = {**os.environ, "BATCHWEB_VAR_DIR": str(scratch), "DEBUG": "0",
           "DJANGO_SETTINGS_MODULE": "batchweb.settings", "ALLOWED_HOSTS": "127.0.0.1",
           "BATCHWEB_ECHO_MODEL": "1", "BATCHWEB_ECHO_SECONDS": str(echo_seconds),
           "BATCHWEB_ECHO_MAX_IN_FLIGHT": str(in_flight),
           "BATCHWEB_SHARD_SIZE": str(args.shard_size), "BATCHWEB_CLEANUP_INTERVAL_SECONDS": "0",
           "LOG_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1"}
    env.pop("DATABASE_URL", None)
    if args.database_url:
        # Each run starts from an empty database, as on SQLite.
        server, _, name = args.database_url.rpartition("/")
        harness.create_database(server, name)
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
        if args.database_url:
            # The planner's statistics, as a deployment's database has them (autovacuum
            # takes a minute or more to gather them for new tables): without them
            # PostgreSQL plans the dashboard's queries for empty tables.
            with harness.pg_connect(args.database_url) as db:
                db.execute("ANALYZE")
        if args.server == "granian":
            server = harness.granian(
                web_port, env, "--workers", str(args.web_workers), "--blocking-threads",
                str(args.threads), *args.server_args.split(),
                app="bench.timed_wsgi:application", stdout=log,
                stderr=subprocess.STDOUT)
        else:
            server = harness.gunicorn(
                web_port, env, "-k", "gthread", "-w", str(args.web_workers), "--threads",
                str(args.threads), "--timeout", "120", "--keep-alive", "30",
                *args.server_args.split(), app="bench.timed_wsgi:application", stdout=log,
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
        live = Op("live", f"/batches/{batch_id}/live", htmx, revalidate=True, follow=True)
        retrieve = Op("retrieve", f"/v1/batches/{batch_id}", api)
        revalidating = Op("retrieve_revalidating", f"/v1/batches/{batch_id}", api,
                          revalidate=True)
        listers = [Op("list_api", "/v1/batches?limit=20", api),
                   Op("list_partial", "/", htmx)]
        heavy = [
            Op("errors", f"/batches/{batch_id}/errors", {}),
            Op("spot_check", f"/batches/{batch_id}/spot-check", {}),
            Op("preflight", "/batches/new", {"X-CSRFToken": cookies["csrftoken"]},
               {"file_id": file["id"], "action": "check", "completion_window": "24h",
                "priority": "default"})]
        clients: list[list[Op]]
        if args.heavy:
            # Let a few shards finish first, so the tabs have results to read.
            time.sleep(min(10.0, args.seconds / 2))
            clients = [heavy] * args.heavy_clients
            shape = f"{args.heavy_clients} clients on the heavy views"
        elif args.api_clients:
            # Client i polls with key i % --keys (1: all share one key, as one program's
            # threads would; one a client: as many programs do).
            keys = [key] + (harness.in_deployment(env, "more_keys", "dash", str(args.keys - 1))
                            if args.keys > 1 else [])
            clients = [[Op("retrieve", retrieve.url,
                           {"Authorization": f"Bearer {keys[i % len(keys)]}"})]
                       for i in range(args.api_clients)]
            shape = f"{args.api_clients} API clients polling the batch with {len(keys)} keys"
        else:
            clients = ([[live, retrieve if i % 2 == 0 else revalidating]
                        for i in range(args.pollers)] + [listers] * args.listers)
            shape = f"{args.pollers} pollers + {args.listers} listers"
        print(f"load: {shape}, every "
              f"{args.interval:g} s, for {args.seconds:g} s against {args.server} "
              f"{args.web_workers}x{args.threads} threads ({database}); batch {batch_id} "
              f"of {args.batch_requests} requests in shards of {args.shard_size} on "
              f"{args.batchworkers} echo worker(s) at {echo_seconds} s/request", flush=True)

        # Warm up (not counted): each web server process imports views and compiles
        # templates on its first requests.
        asyncio.run(warm_up(list({op.name: op for ops in clients for op in ops}.values()),
                            base, cookies))
        stats = Stats()
        load_before = os.getloadavg()
        cpu_before = harness.cpu_seconds(server.pid)
        own_before = time.process_time()

        async def run() -> None:
            now = time.monotonic()
            end = now + args.seconds
            # Many clients start spread over the first interval; a few over at most 2 s.
            spread = min(args.interval, max(2.0, len(clients) / 100)) if args.interval else 0
            await asyncio.gather(*(
                client_loop(ops, base, cookies, now, end, args.interval, stats,
                            random.Random(i), spread)
                for i, ops in enumerate(clients)))

        load_started = time.monotonic()
        asyncio.run(run())
        elapsed = time.monotonic() - load_started
        cpu = harness.cpu_seconds(server.pid) - cpu_before
        own = time.process_time() - own_before
        load_after = os.getloadavg()
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

    nominal = len(clients) / args.interval if args.interval else 0.0
    endpoints = (HEAVY_ENDPOINTS if args.heavy else API_ENDPOINTS if args.api_clients
                 else ENDPOINTS)
    report: dict[str, Any] = {
        "mode": "heavy" if args.heavy else "api" if args.api_clients else "dashboard",
        "seconds": round(elapsed, 1), "interval": args.interval,
        "server": f"{args.server} {args.web_workers}x{args.threads}", "database": database,
        "load_average": [round(load_before[0], 2), round(load_after[0], 2)]}
    if args.heavy:
        report["heavy_clients"] = args.heavy_clients
    elif args.api_clients:
        report["api_clients"] = args.api_clients
    else:
        report.update(pollers=args.pollers, listers=args.listers)
    summarize(report, stats, endpoints, elapsed=elapsed, cpu=cpu, own=own, nominal=nominal)
    progress = after["request_counts"]
    print(f"batch at the end: {after['status']}, {progress['completed']}/{progress['total']}; "
          f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after")
    if after["status"] != "in_progress":
        print("WARNING: the batch ended before the load did (raise --batch-requests)")
    for message in stats.messages:
        print("  ", message)
    report["batch_at_end"] = after["status"]
    report["targets_met"] = targets(report, api=bool(args.api_clients), heavy=args.heavy)
    harness.write_json(args.json, report)


def _ms(values: list[float], q: float) -> float:
    return round(percentile(values, q) * 1000, 1)


def _figures(samples: list[Sample], errors: int = 0, busy: int = 0) -> dict[str, Any]:
    latencies = [s.latency for s in samples]
    count = max(len(samples), 1)
    return {"requests": len(samples) + errors, "p50_ms": _ms(latencies, 0.5),
            "p99_ms": _ms(latencies, 0.99), "max_ms": round(max(latencies, default=0) * 1000, 1),
            "errors": errors, "busy": busy,
            "django_cpu_ms": round(sum(s.cpu_ms for s in samples) / count, 3),
            "django_wall_ms": round(sum(s.app_ms for s in samples) / count, 3),
            "db_ms": round(sum(s.db_ms for s in samples) / count, 3),
            "queries": round(sum(s.queries for s in samples) / count, 2),
            "remembered": round(sum(s.remembered for s in samples) / count, 3)}


def summarize(report: dict[str, Any], stats: Stats, endpoints: dict[str, str], *,
              elapsed: float, cpu: float, own: float, nominal: float) -> None:
    samples = stats.samples
    total = len(samples) + sum(stats.errors.values())
    django_cpu = sum(s.cpu_ms for s in samples) / 1000
    # What the server spends outside the application (parsing, writing, its event loop),
    # shared evenly over the requests: it hardly depends on what was asked.
    server_ms = 1000 * max(0.0, cpu - django_cpu) / max(total, 1)
    offered = stats.sent / elapsed
    print(f"\noffered load: {offered:.1f} requests/s sent ({nominal:.1f}/s if every answer "
          f"were instant), {len(samples) / elapsed:.1f}/s answered")
    print(f"web server CPU: {cpu:.1f} s, {1000 * cpu / max(total, 1):.2f} ms a request "
          f"({1000 * django_cpu / max(total, 1):.2f} in Django, {server_ms:.2f} in the server "
          f"around it); the load generator's own CPU: {own:.1f} s")
    header = (f"{'endpoint':<38} {'requests':>8} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7} "
              f"{'errors':>6} {'busy':>5} {'cpu ms':>7} {'db ms':>6} {'queries':>7} "
              f"{'memo':>5}")
    print("\n" + header)
    rows: dict[str, Any] = {}
    by_op: dict[str, list[Sample]] = defaultdict(list)
    for sample in samples:
        by_op[sample.op].append(sample)

    def line(label: str, figures: dict[str, Any]) -> None:
        # cpu ms: the application's CPU a request plus the server's even share.
        figures["web_cpu_ms"] = round(figures["django_cpu_ms"] + server_ms, 3)
        print(f"{label:<38} {figures['requests']:>8} {figures['p50_ms']:>7.1f} "
              f"{figures['p99_ms']:>7.1f} {figures['max_ms']:>7.1f} {figures['errors']:>6} "
              f"{figures['busy']:>5} {figures['web_cpu_ms']:>7.2f} {figures['db_ms']:>6.2f} "
              f"{figures['queries']:>7.1f} {figures['remembered']:>5.0%}")

    for op, label in endpoints.items():
        figures = _figures(by_op[op], stats.errors[op], stats.busy[op])
        line(label, figures)
        if op in POLLS:
            for kind in ("unchanged", "changed"):
                figures[kind] = _figures([s for s in by_op[op] if s.kind == kind])
                line(f"  {kind}", figures[kind])
        rows[label] = figures
    every = _figures(samples, sum(stats.errors.values()), sum(stats.busy.values()))
    line("all", every)
    polls = [s for s in samples if s.op in POLLS]
    split = {kind: _figures([s for s in polls if s.kind == kind])
             for kind in ("unchanged", "changed")}
    for kind, figures in split.items():
        line(f"every poll, {kind}", figures)
    rows["all"] = every
    report.update(endpoints=rows, polls=split,
                  offered_requests_per_second=round(offered, 1),
                  nominal_requests_per_second=round(nominal, 1),
                  answered_requests_per_second=round(len(samples) / elapsed, 1),
                  web_cpu_seconds=round(cpu, 2),
                  web_cpu_ms_per_request=round(1000 * cpu / max(total, 1), 3),
                  django_cpu_ms_per_request=round(1000 * django_cpu / max(total, 1), 3),
                  server_cpu_ms_per_request=round(server_ms, 3),
                  load_generator_cpu_seconds=round(own, 1))
    # Where the slowest answers went: in Django (and of that, CPU and database) or outside
    # it (queued in the server, the network, the load generator's own event loop).
    slowest = sorted(samples, key=lambda s: s.latency, reverse=True)[:8]
    print("\nslowest: at s, endpoint, status, ms: total / in Django (cpu, db)")
    for s in slowest:
        print(f"  {s.at:6.1f} {s.op:<22} {s.status} {s.latency * 1000:7.1f} / "
              f"{s.app_ms:6.1f} ({s.cpu_ms:.1f}, {s.db_ms:.1f})")
    report["slowest"] = [{"at_s": round(s.at, 2), "op": s.op, "status": s.status,
                          "ms": round(s.latency * 1000, 1), "django_ms": s.app_ms,
                          "django_cpu_ms": s.cpu_ms, "db_ms": s.db_ms} for s in slowest]


def targets(report: dict[str, Any], *, api: bool, heavy: bool) -> bool | None:
    """Whether the shape's targets hold (printed); None for --heavy, which has none."""
    if heavy:
        return None
    every = report["endpoints"]["all"]
    if api:
        met = every["errors"] == 0 and every["p99_ms"] < API_P99_TARGET_MS
        print(f"targets (zero errors, p99 < {API_P99_TARGET_MS:g} ms): "
              f"{'met' if met else 'NOT met'}")
        return met
    misses = [f"{label}: p50 {f['p50_ms']} ms, p99 {f['p99_ms']} ms"
              for label, f in report["endpoints"].items()
              if f["p50_ms"] >= P50_TARGET_MS or f["p99_ms"] >= P99_TARGET_MS]
    unchanged, changed = (report["polls"][k]["web_cpu_ms"] for k in ("unchanged", "changed"))
    if every["errors"]:
        misses.append(f"{every['errors']} errors")
    if unchanged > UNCHANGED_CPU_TARGET_MS:
        misses.append(f"CPU per unchanged poll {unchanged:.2f} ms")
    if changed > CHANGED_CPU_TARGET_MS:
        misses.append(f"CPU per changed poll {changed:.2f} ms")
    print(f"targets (every endpoint p50 < {P50_TARGET_MS:g} ms and p99 < {P99_TARGET_MS:g} ms, "
          f"zero errors, web CPU per poll <= {UNCHANGED_CPU_TARGET_MS:g} ms unchanged and <= "
          f"{CHANGED_CPU_TARGET_MS:g} ms changed): "
          + ("met" if not misses else "NOT met: " + "; ".join(misses)))
    return not misses


if __name__ == "__main__":
    harness.run(main)
