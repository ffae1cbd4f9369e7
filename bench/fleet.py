"""Benchmark: the fleet's ceiling. How many requests a second one PostgreSQL and one Redis
can coordinate across a fleet of workers, and what gives out first.

A fleet of `--workers` `batchworker` processes (64 by default) on the echo engine, which
spends no CPU on a request: it sleeps `--echo-seconds` for each, up to `--in-flight` at once
per worker, like an engine's batch. So the fleet's engines could finish
workers x in-flight / echo-seconds requests a second (8,192 by default), and whatever keeps
it below that is the control plane: the workers' own pipeline (claims, heartbeats,
checkpoints, part files), PostgreSQL, Redis, the web server.

Everything is real and on this machine: the machine's PostgreSQL (a database `--db-name`
created and dropped here), reached through a private PgBouncer in transaction mode unless
`--pooler none` (each worker holds a connection per thread: 64 workers need more than
PostgreSQL's default 100), a private redis-server, Granian, and the workers. `--users`
users each upload one input file of `--batch-size` requests; then the offered load rises in
steps (`--rates`, requests a second): for `--step-seconds` the bench creates batches of
those files (round robin over the users, through the API) at that rate, then waits for them
all to end. Per step it reports:

- requests finished a second (the shards' counters, as heartbeats and finishes record them,
  over the step's window after its first `--warm-seconds`), and each batch's end to end;
- shard-claim, heartbeat and shard-finish latency p50 / p99 as the workers saw them
  (BATCHWEB_TIMINGS_DIR, jobs/worker/timings.py);
- PostgreSQL transactions a second (pg_stat_database: every statement outside a transaction
  is one), rows read and written, connections (pg_stat_activity; the pool's clients and
  waiting clients with PgBouncer);
- Redis commands a second (INFO total_commands_processed);
- CPU per component (psutil: web, workers, PostgreSQL backends of the database, PgBouncer,
  Redis, this client), the machine's busy share and load average (other work on the machine
  shows as "other");
- that every custom_id of every batch appears exactly once across its output and error files.

It stops raising the load at the first step that is saturated (fewer than 90% of the offered
requests finished in its window, or its batches not done `--drain-seconds` after the last
was created) and says which resource was closest to its limit there.

    .venv/bin/python bench/fleet.py                    # 64 workers, 2,000 to 6,000 r/s
    .venv/bin/python bench/fleet.py --quick            # ~2 minutes: 16 workers, one step
    .venv/bin/python bench/fleet.py --workers 96 --rates 2000,4000 --step-seconds 90
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

try:
    from bench import harness
except ImportError:  # run as `python bench/fleet.py`: bench/ itself is on the path
    import harness  # type: ignore[no-redef]

TERMINAL = ("completed", "failed", "expired", "cancelled")
MODEL = "echo-test"
# What a claim may take at the 99th percentile (the target of the fleet's ceiling).
CLAIM_P99_TARGET = 0.050


# --- the services ---


class PgBouncer:
    """A private PgBouncer in transaction mode in front of one database: any number of
    client connections share `pool_size` server connections, each for one transaction."""

    def __init__(self, scratch: Path, *, host: str, port: int, user: str, database: str,
                 pool_size: int) -> None:
        self.dir = scratch / "pgbouncer"
        self.dir.mkdir()
        self.port = harness.free_port()
        self.database = database
        self.user = user
        (self.dir / "users.txt").write_text(f'"{user}" ""\n')
        (self.dir / "pgbouncer.ini").write_text(f"""
[databases]
{database} = host={host} port={port} dbname={database} user={user}
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {self.port}
unix_socket_dir =
auth_type = trust
auth_file = {self.dir}/users.txt
admin_users = {user}
pool_mode = transaction
default_pool_size = {pool_size}
max_client_conn = 5000
max_db_connections = {pool_size}
logfile = {self.dir}/pgbouncer.log
pidfile = {self.dir}/pgbouncer.pid
""")
        # PgBouncer refuses to run as root: it runs as the owner of PostgreSQL's files.
        command = ["pgbouncer", str(self.dir / "pgbouncer.ini")]
        if os.geteuid() == 0:
            command[1:1] = ["-u", "postgres"]
            for path in (scratch, self.dir):
                path.chmod(0o755)
            shutil.chown(self.dir, "postgres")
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        harness.wait_port(self.port, timeout=20)

    @property
    def url(self) -> str:
        return f"postgres://{self.user}@127.0.0.1:{self.port}/{self.database}"

    def pools(self) -> dict[str, int]:
        """Clients active and waiting, server connections, and the longest wait (ms), from
        the admin console."""
        import psycopg

        with psycopg.connect(f"postgres://{self.user}@127.0.0.1:{self.port}/pgbouncer",
                             autocommit=True, prepare_threshold=None) as db:
            cur = db.cursor()
            cur.execute("SHOW POOLS", prepare=False)
            columns = [c.name for c in cur.description or ()]
            for row in cur.fetchall():
                pool = dict(zip(columns, row, strict=True))
                if pool["database"] == self.database:
                    return {"clients": int(pool["cl_active"]) + int(pool["cl_waiting"]),
                            "waiting": int(pool["cl_waiting"]),
                            "servers": int(pool["sv_active"]) + int(pool["sv_idle"])
                            + int(pool["sv_used"]),
                            "maxwait_ms": int(pool["maxwait"]) * 1000
                            + int(pool.get("maxwait_us", 0)) // 1000}
        return {"clients": 0, "waiting": 0, "servers": 0, "maxwait_ms": 0}

    def stop(self) -> None:
        harness.stop(self.proc, timeout=10)


# --- the fleet ---


def write_input(path: Path, user: int, count: int) -> None:
    # Short classification requests (~300 bytes a line), distinct so dedup cannot help.
    with open(path, "w") as out:
        for i in range(count):
            out.write(json.dumps(harness.chat_request(
                f"u{user}-{i}", f"Classify ticket {user}-{i}: my parcel did not arrive.",
                model=MODEL, max_tokens=16)) + "\n")


def start_worker(env: dict[str, str], log: Path, index: int) -> subprocess.Popen:
    return harness.batchworker(MODEL, env, log, "--name", f"fleet-{index}")


def wait_ready(workers: list[subprocess.Popen], logs: list[Path], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    waiting = set(range(len(workers)))
    while waiting:
        for i in list(waiting):
            if b"ready on" in logs[i].read_bytes():
                waiting.discard(i)
            elif workers[i].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker {i} did not start:\n{logs[i].read_text()[-3000:]}")
        time.sleep(0.5)


# --- what is measured ---


class Sampler:
    """Once a second, the figures that are levels rather than counters: connections, the
    pool's waiting clients, Redis's instantaneous ops, the load average."""

    def __init__(self, db_url: str, db_name: str, bouncer: PgBouncer | None,
                 redis_client: Any) -> None:
        self.db_url = db_url
        self.db_name = db_name
        self.bouncer = bouncer
        self.redis = redis_client
        self.samples: list[dict[str, float]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        with harness.pg_connect(self.db_url) as db:
            while not self.stop.wait(1.0):
                connections = db.execute(
                    "SELECT COUNT(*) FROM pg_stat_activity WHERE datname = %s AND pid <> "
                    "pg_backend_pid()", (self.db_name,)).fetchone()[0]
                sample = {"t": time.time(), "pg_connections": connections,
                          "redis_ops": self.redis.info("stats")["instantaneous_ops_per_sec"],
                          "load1": os.getloadavg()[0]}
                if self.bouncer is not None:
                    pools = self.bouncer.pools()
                    sample.update({f"pool_{k}": v for k, v in pools.items()})
                self.samples.append(sample)

    def finish(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


def cpu_of(pids: list[int]) -> float:
    """CPU seconds of these processes and their children."""
    return sum(_cpu_or_zero(pid) for pid in pids)


def _cpu_or_zero(pid: int, *, children: bool = True) -> float:
    import psutil

    try:
        if children:
            return harness.cpu_seconds(pid)
        times = psutil.Process(pid).cpu_times()
        return times.user + times.system
    except psutil.Error:
        return 0.0


class Counters:
    """The cumulative counters read at the start and the end of a window."""

    def __init__(self, fleet: Fleet) -> None:
        import psutil

        self.t = time.time()
        # Busy: what ran on the machine's cores (user, system, interrupts), not time stolen
        # by the hypervisor nor idle waits (guest time is inside user already). Read first,
        # with the clock: reading the rest takes a while on a busy machine.
        times = psutil.cpu_times()
        self.machine_busy = sum(getattr(times, k, 0.0)
                                for k in ("user", "nice", "system", "irq", "softirq"))
        with harness.pg_connect(fleet.direct_url) as db:
            row = db.execute(
                "SELECT xact_commit + xact_rollback, tup_returned + tup_fetched, "
                "tup_inserted + tup_updated + tup_deleted FROM pg_stat_database "
                "WHERE datname = %s", (fleet.db_name,)).fetchone()
            self.pg_xacts, self.pg_read, self.pg_written = row or (0, 0, 0)
            self.finished = db.execute(
                "SELECT COALESCE(SUM(completed + failed), 0) FROM jobs_shard").fetchone()[0]
            # The backends serving the database, and PostgreSQL's own processes (WAL writer,
            # checkpointer...: shared with the machine's other databases, busy with ours).
            backends = [pid for (pid,) in db.execute(
                "SELECT pid FROM pg_stat_activity WHERE (datname = %s OR datname IS NULL) "
                "AND pid <> pg_backend_pid()", (fleet.db_name,)).fetchall()]
        self.postgres = {pid: _cpu_or_zero(pid, children=False) for pid in backends}
        self.redis_commands = fleet.redis.info("stats")["total_commands_processed"]
        self.cpu = {
            "web": cpu_of([fleet.web.pid]),
            "workers": cpu_of([w.pid for w in fleet.workers]),
            "pgbouncer": cpu_of([fleet.bouncer.proc.pid]) if fleet.bouncer else 0.0,
            "redis": cpu_of([fleet.redis_pid]),
            "client": _cpu_or_zero(os.getpid(), children=False),
        }


def latencies(directory: Path, start: float, end: float) -> dict[str, dict[str, float]]:
    """p50 / p99 / max (ms) and count of each timed call made within [start, end]."""
    values: dict[str, list[float]] = defaultdict(list)
    for path in directory.glob("*.txt"):
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 3 and start <= float(parts[0]) <= end:
                values[parts[1]].append(float(parts[2]))
    return {kind: {"p50_ms": 1000 * harness.percentile(v, 0.50),
                   "p99_ms": 1000 * harness.percentile(v, 0.99),
                   "max_ms": 1000 * max(v), "count": len(v)}
            for kind, v in sorted(values.items())}


# --- exactly once ---


def check_exactly_once(fleet: Fleet, batch_ids: list[str], expected: dict[str, int]
                       ) -> dict[str, int]:
    """Every custom_id of each batch's input appears exactly once across its output and
    error files (read from storage, where the finalizer wrote them). Raises otherwise."""
    storage = fleet.scratch / "storage"
    checked = lines = 0
    with harness.pg_connect(fleet.direct_url) as db:
        rows = db.execute(
            "SELECT b.id, b.status, b.input_file_id, o.storage_name, e.storage_name "
            "FROM jobs_batch b LEFT JOIN jobs_file o ON o.id = b.output_file_id "
            "LEFT JOIN jobs_file e ON e.id = b.error_file_id WHERE b.id = ANY(%s)",
            (batch_ids,)).fetchall()
    for batch_id, status, input_id, output, error in rows:
        if status != "completed":
            raise AssertionError(f"batch {batch_id} ended {status}")
        seen: Counter[str] = Counter()
        for name in (output, error):
            if not name:
                continue
            with open(storage / name, "rb") as handle:
                for line in handle:
                    seen[json.loads(line)["custom_id"]] += 1
        twice = [cid for cid, n in seen.items() if n != 1]
        if twice:
            raise AssertionError(f"batch {batch_id}: {len(twice)} custom_ids more than once, "
                                 f"e.g. {twice[:3]}")
        if len(seen) != expected[input_id]:
            raise AssertionError(f"batch {batch_id}: {len(seen)} custom_ids in its files, "
                                 f"{expected[input_id]} in its input")
        prefix = fleet.file_prefix[input_id]
        if any(not cid.startswith(prefix) for cid in seen):
            raise AssertionError(f"batch {batch_id}: a custom_id of another input")
        checked += 1
        lines += len(seen)
    if checked != len(batch_ids):
        raise AssertionError(f"{len(batch_ids) - checked} batches not found")
    return {"batches": checked, "custom_ids": lines}


# --- one deployment, one fleet ---


class Fleet:
    def __init__(self, args: argparse.Namespace, scratch: Path) -> None:
        import redis

        self.args = args
        self.scratch = scratch
        self.db_name = args.db_name
        server = args.database_server.rstrip("/")
        self.direct_url = f"{server}/{self.db_name}"
        harness.create_database(server, self.db_name)
        with harness.pg_connect(f"{server}/postgres") as db:
            self.max_connections = int(db.execute("SHOW max_connections").fetchone()[0])
        self.bouncer: PgBouncer | None = None
        if args.pooler == "pgbouncer":
            from urllib.parse import urlsplit

            parts = urlsplit(server)
            self.bouncer = PgBouncer(scratch, host=parts.hostname or "127.0.0.1",
                                     port=parts.port or 5432, user=parts.username or "postgres",
                                     database=self.db_name, pool_size=args.pool_size)
        self.timings = scratch / "timings"
        self.env = {**os.environ, "BATCHWEB_VAR_DIR": str(scratch),
                    "DATABASE_URL": self.bouncer.url if self.bouncer else self.direct_url,
                    "BATCHWEB_ECHO_MODEL": "1",
                    "BATCHWEB_ECHO_SECONDS": str(args.echo_seconds),
                    "BATCHWEB_ECHO_MAX_IN_FLIGHT": str(args.in_flight),
                    "BATCHWEB_SHARD_SIZE": str(args.shard_size),
                    "BATCHWEB_TIMINGS_DIR": str(self.timings),
                    "BATCHWEB_HTTPS": "0", "LOG_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1"}
        if self.bouncer:
            self.env["DB_TRANSACTION_POOLING"] = "1"
        self.env.setdefault("BATCHWEB_MODELS_DIR", str(harness.ROOT / "var" / "models"))
        # Migrations straight to PostgreSQL; everything else as the deployment runs it.
        harness.manage({**self.env, "DATABASE_URL": self.direct_url}, "migrate", "-v0")
        self.keys: list[str] = harness.in_deployment(self.env, "keys", str(args.users))
        self.redis = redis.Redis.from_url(os.environ["REDIS_URL"])
        self.redis_pid = int((scratch / "redis" / "redis.pid").read_text())
        port = harness.free_port()
        self.base_url = f"http://127.0.0.1:{port}/v1"
        self.web = harness.granian(port, self.env, "--workers", "1", "--blocking-threads", "8",
                                   stderr=subprocess.DEVNULL)
        harness.wait_http(f"http://127.0.0.1:{port}/v1/models")
        self.workers: list[subprocess.Popen] = []
        self.file_prefix: dict[str, str] = {}
        self.expected: dict[str, int] = {}

    def upload_inputs(self) -> list[str]:
        import openai

        file_ids = []
        for user, key in enumerate(self.keys):
            path = self.scratch / f"input-{user}.jsonl"
            write_input(path, user, self.args.batch_size)
            client = openai.OpenAI(base_url=self.base_url, api_key=key, max_retries=3)
            file = client.files.create(file=path.open("rb"), purpose="batch")
            self.file_prefix[file.id] = f"u{user}-"
            self.expected[file.id] = self.args.batch_size
            file_ids.append(file.id)
            path.unlink()
        return file_ids

    def start_workers(self) -> float:
        started = time.monotonic()
        logs = [self.scratch / f"worker-{i}.log" for i in range(self.args.workers)]
        self.workers = [start_worker(self.env, log, i) for i, log in enumerate(logs)]
        wait_ready(self.workers, logs, timeout=600)
        return time.monotonic() - started

    def stop(self) -> None:
        for worker in self.workers:
            if worker.poll() is None:
                worker.terminate()
        for worker in self.workers:
            harness.stop(worker, timeout=90)
        harness.stop(self.web, timeout=30)
        if self.bouncer:
            self.bouncer.stop()

    def statuses(self, batch_ids: list[str]) -> Counter[str]:
        with harness.pg_connect(self.direct_url) as db:
            return Counter(status for (status,) in db.execute(
                "SELECT status FROM jobs_batch WHERE id = ANY(%s)", (batch_ids,)).fetchall())

    def shard_state(self) -> dict[str, int]:
        with harness.pg_connect(self.direct_url) as db:
            rows = db.execute("SELECT status, COUNT(*), COALESCE(SUM(failures), 0) "
                              "FROM jobs_shard GROUP BY status").fetchall()
        state = {status: count for status, count, _ in rows}
        state["failures"] = sum(int(f) for _, _, f in rows)
        return state


# --- one step ---


def run_step(fleet: Fleet, file_ids: list[str], rate: float) -> dict[str, Any]:
    import httpx

    args = fleet.args
    clients = [httpx.Client(base_url=fleet.base_url, timeout=60,
                            headers={"Authorization": f"Bearer {key}"}) for key in fleet.keys]
    interval = args.batch_size / rate
    sampler = Sampler(fleet.direct_url, fleet.db_name, fleet.bouncer, fleet.redis)
    created: list[str] = []
    create_seconds: list[float] = []
    start = time.monotonic()
    before = None
    sampler.start()
    warm_end = start + args.warm_seconds
    step_end = start + args.step_seconds
    n = 0
    while (due := start + n * interval) < step_end:
        if before is None and warm_end <= due:
            time.sleep(max(0.0, warm_end - time.monotonic()))
            before = Counters(fleet)
        time.sleep(max(0.0, due - time.monotonic()))
        i = n % len(file_ids)
        t0 = time.monotonic()
        answer = clients[i].post("/batches", json={
            "input_file_id": file_ids[i], "endpoint": "/v1/chat/completions",
            "completion_window": "24h"})
        create_seconds.append(time.monotonic() - t0)
        answer.raise_for_status()
        created.append(answer.json()["id"])
        n += 1
    if before is None:
        time.sleep(max(0.0, warm_end - time.monotonic()))
        before = Counters(fleet)
    time.sleep(max(0.0, step_end - time.monotonic()))
    after = Counters(fleet)
    sampler.finish()
    window = after.t - before.t

    # Drain: every batch of the step ends (or the step is saturated).
    deadline = time.monotonic() + args.drain_seconds
    while (statuses := fleet.statuses(created)) and sum(
            statuses[s] for s in TERMINAL) < len(created) and time.monotonic() < deadline:
        time.sleep(1)
    drained = sum(statuses[s] for s in TERMINAL) == len(created)
    end_to_end = time.monotonic() - start
    for client in clients:
        client.close()

    finished = after.finished - before.finished
    cpu = {k: 100 * (after.cpu[k] - before.cpu[k]) / window for k in before.cpu}
    # Backends that started in the window count whole; those that ended in it are missed.
    cpu["postgres"] = 100 * sum(seconds - before.postgres.get(pid, 0.0)
                                for pid, seconds in after.postgres.items()) / window
    machine = 100 * (after.machine_busy - before.machine_busy) / window
    cpu["other"] = max(0.0, machine - sum(cpu.values()))
    samples = [s for s in sampler.samples if before.t <= s["t"] <= after.t] or sampler.samples
    lat = latencies(fleet.timings, before.t, after.t)

    def level(key: str, how: Any = max) -> float:
        values = [s[key] for s in samples if key in s]
        return how(values) if values else 0.0

    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    shared = sum(after.cpu[k] - before.cpu[k] for k in ("pgbouncer", "redis")) + sum(
        seconds - before.postgres.get(pid, 0.0) for pid, seconds in after.postgres.items())
    row: dict[str, Any] = {
        "offered_rps": rate, "batches": len(created), "window_s": window,
        "finished_rps": finished / window,
        # CPU a finished request cost: in the workers, and in the shared services
        # (PostgreSQL, PgBouncer, Redis), whatever else the machine was doing.
        "worker_cpu_us_per_request": 1e6 * (after.cpu["workers"] - before.cpu["workers"])
        / max(1, finished),
        "shared_cpu_us_per_request": 1e6 * shared / max(1, finished),
        "end_to_end_rps": len(created) * args.batch_size / end_to_end if drained else 0.0,
        "drained": drained, "statuses": dict(statuses),
        "create_p99_ms": 1000 * harness.percentile(create_seconds, 0.99),
        "latency": lat,
        "pg_xact_per_s": (after.pg_xacts - before.pg_xacts) / window,
        "pg_rows_read_per_s": (after.pg_read - before.pg_read) / window,
        "pg_rows_written_per_s": (after.pg_written - before.pg_written) / window,
        "pg_connections_max": level("pg_connections"),
        "pg_connections_mean": level("pg_connections", mean),
        "redis_commands_per_s": (after.redis_commands - before.redis_commands) / window,
        "redis_ops_max": level("redis_ops"),
        "cpu_pct": cpu, "machine_busy_pct": machine,
        "load1_mean": level("load1", mean), "load1_max": level("load1"),
        "shards": fleet.shard_state(),
    }
    if fleet.bouncer:
        row.update({"pool_clients_max": level("pool_clients"),
                    "pool_waiting_max": level("pool_waiting"),
                    "pool_servers_max": level("pool_servers"),
                    "pool_maxwait_ms_max": level("pool_maxwait_ms")})
    if drained:
        row["exactly_once"] = check_exactly_once(fleet, created, fleet.expected)
    row["saturated"] = (not drained) or row["finished_rps"] < 0.9 * rate
    row["bound"] = bound(row, fleet)
    return row


def bound(row: dict[str, Any], fleet: Fleet) -> str:
    """Which resource was closest to its limit in the step: a sentence."""
    cpu = row["cpu_pct"]
    cores = os.cpu_count() or 1
    top = sorted(((v, k) for k, v in cpu.items()), reverse=True)[:3]
    share = ", ".join(f"{k} {v:.0f}%" for v, k in top)
    notes = []
    if row["machine_busy_pct"] >= 90 * cores:
        notes.append(f"CPU: the machine's {cores} cores busy {row['machine_busy_pct']:.0f}% "
                     f"of {100 * cores}% ({share})")
    else:
        notes.append(f"CPU {row['machine_busy_pct']:.0f}% of {100 * cores}% ({share})")
    if row.get("pool_waiting_max", 0) > 0:
        notes.append(f"pool: up to {row['pool_waiting_max']:.0f} clients waiting for one of "
                     f"{fleet.args.pool_size} server connections "
                     f"(longest {row['pool_maxwait_ms_max']:.0f} ms)")
    claim = row["latency"].get("claim", {})
    if claim.get("p99_ms", 0) >= 1000 * CLAIM_P99_TARGET:
        notes.append(f"claim p99 {claim['p99_ms']:.0f} ms")
    capacity = fleet.args.workers * fleet.args.in_flight / fleet.args.echo_seconds
    if row["offered_rps"] >= 0.9 * capacity:
        notes.append(f"the engines' own capacity ({capacity:.0f} r/s)")
    return "; ".join(notes)


# --- the report ---


def print_row(row: dict[str, Any]) -> None:
    lat = row["latency"]

    def p(kind: str) -> str:
        entry = lat.get(kind)
        return f"{entry['p50_ms']:.1f}/{entry['p99_ms']:.1f}" if entry else "-"

    cpu = row["cpu_pct"]
    print(f"{row['offered_rps']:>8.0f} {row['finished_rps']:>9.0f} {row['end_to_end_rps']:>8.0f} "
          f"{p('claim'):>12} {p('heartbeat'):>12} {p('finish'):>12} "
          f"{row['pg_xact_per_s']:>7.0f} {row['pg_connections_max']:>5.0f} "
          f"{row['redis_commands_per_s']:>7.0f} "
          f"{row['worker_cpu_us_per_request']:>6.0f} {row['shared_cpu_us_per_request']:>6.0f} "
          f"{cpu['workers']:>5.0f} {cpu['postgres']:>5.0f} {cpu['pgbouncer']:>5.0f} "
          f"{cpu['redis']:>5.0f} {cpu['web']:>5.0f} {cpu['client']:>5.0f} {cpu['other']:>5.0f} "
          f"{row['load1_mean']:>5.1f} {'yes' if row['saturated'] else 'no':>4}", flush=True)


HEADER = (f"{'offered':>8} {'finished':>9} {'e2e':>8} {'claim p50/99':>12} "
          f"{'hbeat p50/99':>12} {'finish 50/99':>12} {'pg tx/s':>7} {'conns':>5} "
          f"{'redis/s':>7} {'wrk us':>6} {'shr us':>6} {'wrk%':>5} {'pg%':>5} {'bnc%':>5} "
          f"{'rds%':>5} {'web%':>5} {'cli%':>5} {'oth%':>5} {'load':>5} {'sat':>4}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--rates", default="2000,3000,4000,5000,6000",
                        help="offered load of each step, requests a second")
    parser.add_argument("--step-seconds", type=float, default=60)
    parser.add_argument("--warm-seconds", type=float, default=20,
                        help="the start of each step left out of its window")
    parser.add_argument("--drain-seconds", type=float, default=120)
    parser.add_argument("--batch-size", type=int, default=10_000)
    parser.add_argument("--shard-size", type=int, default=1000)
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--echo-seconds", type=float, default=0.5)
    parser.add_argument("--in-flight", type=int, default=64,
                        help="requests each worker's engine runs at once")
    parser.add_argument("--database-server", default="postgres://postgres@127.0.0.1:5432")
    parser.add_argument("--db-name", default="batchweb_fleet")
    parser.add_argument("--pooler", choices=("pgbouncer", "none"), default="pgbouncer")
    parser.add_argument("--pool-size", type=int, default=20,
                        help="PgBouncer's server connections")
    parser.add_argument("--keep-going", action="store_true",
                        help="run every step, also after a saturated one")
    parser.add_argument("--quick", action="store_true",
                        help="~2 minutes: 16 workers, one 30 s step at 1,000 r/s")
    harness.add_json_option(parser)
    args = parser.parse_args()
    if args.quick:
        args.workers, args.rates, args.batch_size, args.users = 16, "1000", 5000, 4
        args.step_seconds, args.warm_seconds, args.drain_seconds = 30, 10, 60
    if args.pooler == "pgbouncer" and shutil.which("pgbouncer") is None:
        if not args.quick:
            sys.exit("pgbouncer is not installed (apt-get install pgbouncer); or --pooler none "
                     "with few enough workers for PostgreSQL's max_connections")
        # 16 workers hold ~70 connections: under PostgreSQL's default 100.
        print("pgbouncer is not installed: the quick run connects straight to PostgreSQL")
        args.pooler = "none"
    try:
        with harness.pg_connect(f"{args.database_server.rstrip('/')}/postgres", connect_timeout=5):
            pass
    except Exception as exc:
        sys.exit(f"PostgreSQL at {args.database_server} does not answer ({exc}): the fleet "
                 "needs one (--database-server)")

    scratch = Path(tempfile.mkdtemp(prefix="bw-fleet-"))
    rows: list[dict[str, Any]] = []
    fleet: Fleet | None = None
    load_start = os.getloadavg()
    try:
        with harness.private_redis(scratch):
            fleet = Fleet(args, scratch)
            file_ids = fleet.upload_inputs()
            ready = fleet.start_workers()
            database = (f"PgBouncer (transaction pooling, {args.pool_size} connections)"
                        if fleet.bouncer else "direct connections")
            print(f"{args.workers} workers ready in {ready:.0f} s; engines' capacity "
                  f"{args.workers * args.in_flight / args.echo_seconds:.0f} r/s "
                  f"({args.in_flight} in flight x {args.echo_seconds} s each); batches of "
                  f"{args.batch_size} requests, shards of {args.shard_size}, "
                  f"{args.users} users; database through {database}", flush=True)
            print(HEADER, flush=True)
            for rate in (float(r) for r in args.rates.split(",")):
                row = run_step(fleet, file_ids, rate)
                rows.append(row)
                print_row(row)
                print("    latency p50/p99/max ms (count): " + ", ".join(
                    f"{kind} {v['p50_ms']:.1f}/{v['p99_ms']:.1f}/{v['max_ms']:.0f} "
                    f"({v['count']})" for kind, v in row["latency"].items()), flush=True)
                print(f"    bound: {row['bound']}", flush=True)
                if fleet.bouncer:
                    print(f"    database: {row['pool_clients_max']:.0f} client connections "
                          f"through PgBouncer on {row['pool_servers_max']:.0f} of "
                          f"PostgreSQL's (max_connections {fleet.max_connections})",
                          flush=True)
                if row["saturated"] and not args.keep_going:
                    break
    finally:
        if fleet is not None:
            fleet.stop()
        harness.drop_database(args.database_server.rstrip("/"), args.db_name)
        harness.remove(scratch)
    report(args, rows, load_start)


def report(args: argparse.Namespace, rows: list[dict[str, Any]],
           load_start: tuple[float, float, float]) -> None:
    good = [r for r in rows if not r["saturated"] and "exactly_once" in r
            and r["latency"].get("claim", {}).get("p99_ms", 0) < 1000 * CLAIM_P99_TARGET]
    ceiling = max(good, key=lambda r: r["finished_rps"]) if good else None
    saturated = next((r for r in rows if r["saturated"]), None)
    print()
    if ceiling:
        claim = ceiling["latency"].get("claim", {})
        print(f"ceiling: {ceiling['finished_rps']:.0f} requests/s finished at "
              f"{ceiling['offered_rps']:.0f} offered, claim p99 {claim.get('p99_ms', 0):.1f} ms, "
              f"every custom_id once ({ceiling['exactly_once']['custom_ids']} checked)")
    else:
        print("ceiling: no step met the targets")
    if saturated:
        print(f"saturated at {saturated['offered_rps']:.0f} offered "
              f"({saturated['finished_rps']:.0f} finished): {saturated['bound']}")
    during = ", ".join(f"{r['load1_mean']:.1f}" for r in rows)
    print(f"load average at start {load_start[0]:.2f}, during the steps {during}")
    harness.write_json(args.json, {
        "workers": args.workers, "echo_seconds": args.echo_seconds,
        "in_flight": args.in_flight, "batch_size": args.batch_size,
        "shard_size": args.shard_size, "users": args.users, "pooler": args.pooler,
        "pool_size": args.pool_size, "load_start": load_start, "steps": rows,
        "cpu": harness.cpu_model(),
        "ceiling_rps": ceiling["finished_rps"] if ceiling else 0.0,
        "saturated_at": saturated["offered_rps"] if saturated else None})


if __name__ == "__main__":
    harness.run(main)
