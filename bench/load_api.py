"""Load: 200 concurrent API clients for 60 s against Granian with real workers.

Starts, on loopback only: a private redis-server, Granian (WSGI) serving batchweb, and
`batchworker` processes with the echo engine; creates users and keys; then runs CLIENTS
asyncio clients (httpx) for SECONDS, each doing what a real user does: upload small batch
files, create batches, poll them, list files and batches, download inputs and results.
Every client is bounded (at most --max-batches batches each), so the run is too.

At the end it checks that nothing was lost (every file created is retrievable with its
bytes, every batch created completes with all its requests) and reports p50/p99 latency per
operation and overall, the number of 5xx answers and of transport errors.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/batchweb_load \\
        .venv/bin/python bench/load_api.py [--clients 200] [--seconds 60]

DATABASE_URL must name a scratch database (it is migrated; rows are added). Without it a
SQLite file in a temporary directory is used (expect lock waits with many clients).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

try:
    from bench import harness
except ImportError:  # run as `python bench/load_api.py`: bench/ itself is on the path
    import harness  # type: ignore[no-redef]

percentile = harness.percentile
TERMINAL = {"completed", "failed", "expired", "cancelled"}


def batch_file(tag: str, lines: int) -> bytes:
    return harness.jsonl([harness.chat_request(f"{tag}-{i}", f"load test {tag} {i}",
                                               max_tokens=8) for i in range(lines)])


@dataclass
class Stats:
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    status: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    server_errors: list[str] = field(default_factory=list)
    transport_errors: list[str] = field(default_factory=list)
    files: dict[str, int] = field(default_factory=dict)  # file id -> bytes
    batches: dict[str, tuple[str, int]] = field(default_factory=dict)  # id -> (key, requests)


async def call(client: httpx.AsyncClient, stats: Stats, op: str, method: str, url: str,
               **kwargs: Any) -> httpx.Response | None:
    started = time.perf_counter()
    try:
        response = await client.request(method, url, **kwargs)
        if op == "download":
            await response.aread()
    except httpx.HTTPError as exc:
        stats.transport_errors.append(f"{op} {url}: {type(exc).__name__}: {exc}")
        return None
    stats.latencies[op].append(time.perf_counter() - started)
    stats.status[response.status_code] += 1
    if response.status_code >= 500:
        stats.server_errors.append(f"{op} {url}: {response.status_code} {response.text[:200]}")
    return response


async def user_loop(number: int, base: str, key: str, deadline: float, stats: Stats,
                    max_batches: int, lines: int) -> None:
    rng = random.Random(number)
    headers = {"Authorization": f"Bearer {key}"}
    files: list[str] = []
    batches: list[str] = []
    outputs: list[str] = []
    limits = httpx.Limits(keepalive_expiry=10)
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=120,
                                 limits=limits) as client:
        while time.monotonic() < deadline:
            roll = rng.random()
            if roll < 0.12 and len(files) < max_batches:
                content = batch_file(f"c{number}-{len(files)}", lines)
                response = await call(client, stats, "upload", "POST", "/v1/files",
                                      files={"file": ("in.jsonl", content)},
                                      data={"purpose": "batch"})
                if response is not None and response.status_code == 200:
                    file_id = response.json()["id"]
                    files.append(file_id)
                    stats.files[file_id] = len(content)
            elif roll < 0.22 and len(batches) < len(files):
                file_id = files[len(batches)]
                response = await call(client, stats, "create_batch", "POST", "/v1/batches",
                                      json={"input_file_id": file_id,
                                            "endpoint": "/v1/chat/completions",
                                            "completion_window": "24h"})
                if response is not None and response.status_code == 200:
                    batch_id = response.json()["id"]
                    batches.append(batch_id)
                    stats.batches[batch_id] = (key, lines)
            elif roll < 0.55 and batches:
                batch_id = rng.choice(batches)
                response = await call(client, stats, "poll_batch", "GET",
                                      f"/v1/batches/{batch_id}")
                if response is not None and response.status_code == 200:
                    body = response.json()
                    if body["output_file_id"] and body["output_file_id"] not in outputs:
                        outputs.append(body["output_file_id"])
            elif roll < 0.67:
                await call(client, stats, "list_files", "GET", "/v1/files",
                           params={"limit": 20})
            elif roll < 0.79:
                await call(client, stats, "list_batches", "GET", "/v1/batches",
                           params={"limit": 20})
            elif roll < 0.95 and (files or outputs):
                file_id = rng.choice(outputs or files)
                await call(client, stats, "download", "GET", f"/v1/files/{file_id}/content")
            else:
                await call(client, stats, "models", "GET", "/v1/models")
            await asyncio.sleep(rng.uniform(0, 0.05))


async def check_nothing_lost(base: str, stats: Stats, keys: list[str], timeout: float
                             ) -> dict[str, Any]:
    """Every file is there with its bytes; every batch completes with all its requests."""
    lost_files: list[str] = []
    unfinished: list[str] = []
    wrong: list[str] = []
    by_key: dict[str, str] = {}
    for file_id in stats.files:
        by_key[file_id] = ""
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        semaphore = asyncio.Semaphore(20)

        async def check_file(file_id: str, size: int) -> None:
            async with semaphore:
                for key in keys:  # the file's owner is one of the keys
                    r = await client.get(f"/v1/files/{file_id}",
                                         headers={"Authorization": f"Bearer {key}"})
                    if r.status_code == 200:
                        if r.json()["bytes"] != size:
                            wrong.append(file_id)
                        return
                lost_files.append(file_id)

        await asyncio.gather(*(check_file(f, s) for f, s in stats.files.items()))
        deadline = time.monotonic() + timeout
        pending = dict(stats.batches)
        while pending and time.monotonic() < deadline:
            for batch_id, (key, lines) in list(pending.items()):
                r = await client.get(f"/v1/batches/{batch_id}",
                                     headers={"Authorization": f"Bearer {key}"})
                body = r.json()
                if body.get("status") in TERMINAL:
                    counts = body["request_counts"]
                    if body["status"] != "completed" or counts != {
                            "total": lines, "completed": lines, "failed": 0}:
                        wrong.append(f"{batch_id} {body['status']} {counts}")
                    del pending[batch_id]
            if pending:
                await asyncio.sleep(2)
        unfinished = list(pending)
    return {"files": len(stats.files), "batches": len(stats.batches),
            "lost_files": lost_files, "unfinished_batches": unfinished, "wrong": wrong}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--users", type=int, default=20)
    parser.add_argument("--web-workers", "--gunicorn-workers", dest="web_workers", type=int,
                        default=3)
    parser.add_argument("--threads", type=int, default=16, help="per web worker")
    parser.add_argument("--batchworkers", type=int, default=2)
    parser.add_argument("--max-batches", type=int, default=2, help="per client")
    parser.add_argument("--lines", type=int, default=20, help="requests per batch file")
    parser.add_argument("--settle", type=float, default=300,
                        help="seconds to wait for batches to complete after the load")
    harness.add_json_option(parser)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="batchweb-load-"))
    redis_port, web_port = harness.free_port(), harness.free_port()
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "batchweb.settings", "DEBUG": "0",
           "ALLOWED_HOSTS": "127.0.0.1,localhost", "BATCHWEB_ECHO_MODEL": "1",
           "BATCHWEB_ECHO_SECONDS": "0", "REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
           "BATCHWEB_STORAGE_DIR": str(work / "storage"), "BATCHWEB_TMP_DIR": str(work / "tmp"),
           "BATCHWEB_CLEANUP_INTERVAL_SECONDS": "0", "LOG_LEVEL": "WARNING",
           "DB_CONN_MAX_AGE": "60"}
    env.setdefault("DATABASE_URL", f"sqlite:///{work / 'load.sqlite3'}")
    procs: list[subprocess.Popen] = []
    logs = open(work / "services.log", "wb")  # noqa: SIM115

    # Each in a session of its own, so that stopping it stops what it started.
    detached: dict[str, Any] = {"stdout": logs, "stderr": subprocess.STDOUT,
                                "start_new_session": True}
    try:
        procs.append(subprocess.Popen(
            [shutil.which("redis-server") or "redis-server", "--port", str(redis_port),
             "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(work)],
            env=env, cwd=harness.ROOT, **detached))
        harness.manage(env, "migrate", "--noinput", "-v0")
        keys = harness.in_deployment(env, "keys", str(args.users))
        harness.wait_port(redis_port)
        # Granian closes a connection idle for 30 s (its --http1-header-read-timeout), longer
        # than the clients keep idle connections: otherwise the server could close one just
        # as a client reuses it (a transport error that is no server fault).
        procs.append(harness.granian(
            web_port, env, "--workers", str(args.web_workers),
            "--blocking-threads", str(args.threads), "--backlog", "2048", **detached))
        for _ in range(args.batchworkers):
            procs.append(harness.batchworker("echo-test", env, logs,
                                             start_new_session=True))
        harness.wait_port(web_port)
        base = f"http://127.0.0.1:{web_port}"
        stats = Stats()
        print(f"load: {args.clients} clients for {args.seconds:.0f} s against {base} "
              f"(Granian {args.web_workers}x{args.threads} threads, "
              f"{args.batchworkers} batchworkers, {env['DATABASE_URL'].split(':')[0]})")

        async def run() -> dict[str, Any]:
            deadline = time.monotonic() + args.seconds
            await asyncio.gather(*(user_loop(i, base, keys[i % len(keys)], deadline, stats,
                                             args.max_batches, args.lines)
                                   for i in range(args.clients)))
            return await check_nothing_lost(base, stats, keys, args.settle)

        started = time.monotonic()
        integrity = asyncio.run(run())
        elapsed = time.monotonic() - started
        every = [v for values in stats.latencies.values() for v in values]
        report = {
            "clients": args.clients, "seconds": args.seconds,
            "requests": len(every), "throughput_rps": round(len(every) / args.seconds, 1),
            "p50_ms": round(percentile(every, 0.5) * 1000, 1),
            "p99_ms": round(percentile(every, 0.99) * 1000, 1),
            "status": dict(sorted(stats.status.items())),
            "server_errors_5xx": len(stats.server_errors),
            "transport_errors": len(stats.transport_errors),
            "per_operation": {op: {"n": len(v), "p50_ms": round(statistics.median(v) * 1000, 1),
                                   "p99_ms": round(percentile(v, 0.99) * 1000, 1)}
                              for op, v in sorted(stats.latencies.items())},
            "integrity": integrity, "total_seconds": round(elapsed, 1),
        }
        print(json.dumps(report, indent=2))
        for line in (stats.server_errors + stats.transport_errors)[:10]:
            print("  ", line)
        harness.write_json(args.json, report)
        ok = (not stats.server_errors and not stats.transport_errors
              and not integrity["lost_files"] and not integrity["unfinished_batches"]
              and not integrity["wrong"])
        print("load: OK" if ok else f"load: FAILED (logs in {work / 'services.log'})")
        sys.exit(0 if ok else 1)
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        logs.close()


if __name__ == "__main__":
    harness.run(main)
