"""Workers on other hosts: a machine dies mid-batch and the other finishes its work.

Each host is a network namespace with its own address, host name and directory (see
cluster.py); the services are reached by address only, files live in S3 (moto's server),
and a worker host sees neither the web host's files nor the other worker host's. Run
with `make chaos` (about two minutes)."""

from __future__ import annotations

import json
import os
import random
import secrets
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from jobs.management.commands.runservice import web_server
from jobs.storage.embedded import PrivateS3, s3_storage_env
from tests.chaos.cluster import PY, Cluster, Host, start_postgres, start_redis, start_s3
from tests.factories import ROOT, chat_line, jsonl, prometheus_values, wait_for

pytestmark = [pytest.mark.chaos]

REQUESTS = 3000
SHARD_SIZE = 100
WORKERS_PER_HOST = 2
METRICS_TOKEN = secrets.token_hex(16)  # what the settings accept: 32 characters
# Timings short enough for a test: shard and RQ heartbeats every second, a silent worker's
# shards retried after 12 s, a reconcile pass every 2 s in every worker. PostgreSQL then
# drops a dead host's sessions after ~6 s (BATCHWEB_DB_DEAD_CLIENT_SECONDS defaults to a
# quarter of the heartbeat timeout: 3 s quiet, then 3 probes a second apart).
TIMINGS = {"BATCHWEB_HEARTBEAT_SECONDS": "1", "BATCHWEB_HEARTBEAT_TIMEOUT_SECONDS": "12",
           "BATCHWEB_RECONCILE_SECONDS": "2", "BATCHWEB_SHARD_RETRY_BASE_SECONDS": "1"}
# The echo engine slowed to 20 requests/s per worker (4 in flight, 0.2 s each): the batch
# takes about 40 s on four workers, long enough to lose a host in the middle of it.
ECHO = {"BATCHWEB_ECHO_MODEL": "1", "BATCHWEB_ECHO_SECONDS": "0.2",
        "BATCHWEB_ECHO_MAX_IN_FLIGHT": "4"}


def host_env(host: Host, *, database_url: str, redis_url: str, s3: dict[str, str]
             ) -> dict[str, str]:
    """What a batchweb process on `host` is given: the services' addresses and its own
    directories; nothing of this machine's environment but PATH."""
    return {"PATH": os.environ["PATH"], "LANG": "C.UTF-8", "HOME": str(host.dir),
            "PYTHONPATH": str(ROOT), "DJANGO_SETTINGS_MODULE": "tests.settings",
            "DATABASE_URL": database_url, "REDIS_URL": redis_url, **s3,
            "BATCHWEB_VAR_DIR": str(host.dir / "var"), "BATCHWEB_TMP_DIR": str(host.dir / "tmp"),
            # Never used with S3 storage: the test checks nothing was written there.
            "BATCHWEB_STORAGE_DIR": str(host.dir / "local-storage"),
            "BATCHWEB_MODELS_DIR": str(host.dir / "models"),
            "BATCHWEB_SHARD_SIZE": str(SHARD_SIZE), "BATCHWEB_SHARD_MAX_ATTEMPTS": "10",
            "BATCHWEB_CLEANUP_INTERVAL_SECONDS": "0", "DB_CONN_MAX_AGE": "60",
            "BATCHWEB_HTTPS": "0", "LOG_LEVEL": "INFO", **TIMINGS, **ECHO}


class Db:
    """The cluster's database, read directly by the test (it is not Django's test
    database: the test process is no host of the cluster)."""

    def __init__(self, url: str) -> None:
        import psycopg

        self.conn = psycopg.connect(url, autocommit=True)

    def rows(self, sql: str, *args: Any) -> list[tuple]:
        with self.conn.cursor() as cursor:
            cursor.execute(sql, args)
            return cursor.fetchall()

    def sessions(self, address: str | None = None) -> list[tuple]:
        """The cluster's sessions (but this one): client, state, what it waits for, its
        transaction's age, the start of its last query."""
        return self.rows(
            "SELECT host(client_addr), state, wait_event_type, wait_event, "
            "now() - xact_start, left(query, 100) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid() "
            "AND (%s::text IS NULL OR host(client_addr) = %s)", address, address)

    def shards(self, batch_id: str) -> list[dict[str, Any]]:
        names = ("id", "index", "status", "worker", "attempt", "failures", "completed",
                 "failed", "recomputed", "last_error")
        columns = ", ".join(f'"{name}"' for name in names)
        return [dict(zip(names, row, strict=True)) for row in self.rows(
            f'SELECT {columns} FROM jobs_shard WHERE batch_id = %s ORDER BY "index"',
            batch_id)]


def host_of(worker: str) -> str:
    return worker.split(".", 1)[0]


@pytest.fixture
def services(cluster: Cluster) -> Iterator[dict[str, str]]:
    """PostgreSQL, Redis and S3 on the `svc` host, a database and a bucket of the test's."""
    import boto3
    import psycopg
    from botocore.config import Config

    svc = cluster.hosts["svc"]
    server = start_postgres(cluster, svc)
    with psycopg.connect(f"{server}/postgres", autocommit=True) as conn:
        conn.execute("CREATE DATABASE batchweb_multihost")
    redis_url = start_redis(svc)
    s3_url = start_s3(svc)
    boto3.client("s3", endpoint_url=s3_url, region_name="us-east-1",
                 aws_access_key_id=PrivateS3.ACCESS_KEY,
                 aws_secret_access_key=PrivateS3.SECRET_KEY,
                 config=Config(s3={"addressing_style": "path"})
                 ).create_bucket(Bucket="batchweb")
    yield {"database_url": f"{server}/batchweb_multihost", "redis_url": redis_url,
           "s3_url": s3_url}


def test_a_host_dies_mid_batch_and_the_other_host_finishes_it(cluster: Cluster,
                                                             services: dict[str, str]):
    started = time.monotonic()
    web, victim, survivor = (cluster.hosts[n] for n in ("web", "host-b", "host-a"))
    s3 = s3_storage_env(services["s3_url"], "batchweb", "multihost")

    def env(host: Host, **extra: str) -> dict[str, str]:
        return {**host_env(host, database_url=services["database_url"],
                           redis_url=services["redis_url"], s3=s3), **extra}

    web_env = env(web, ALLOWED_HOSTS=web.address, BATCHWEB_METRICS_TOKEN=METRICS_TOKEN)
    manage = [PY, str(ROOT / "manage.py")]
    web.call([*manage, "migrate", "--noinput", "-v0"], web_env, timeout=300)
    key = web.call([*manage, "shell", "-c", (
        "from django.contrib.auth import get_user_model; "
        "from jobs.services.keys import create_api_key; "
        "u = get_user_model().objects.create_user('multihost', password='pw-multihost-1'); "
        "print(create_api_key(owner=u, name='chaos')[1])")], web_env).split()[-1]
    granian = web.start("granian", web_server(f"{web.address}:8000", 2), web_env)
    for host in (survivor, victim):
        for i in range(WORKERS_PER_HOST):
            host.start(f"worker-{i}", [*manage, "batchworker", "--model", "echo-test"],
                       env(host))
    db = Db(services["database_url"])
    api = httpx.Client(base_url=f"http://{web.address}:8000",
                       headers={"Authorization": f"Bearer {key}"}, timeout=60)
    try:
        run_the_batch(cluster, db, api, victim=victim, survivor=survivor,
                      web_alive=lambda: granian.poll() is None)
    except BaseException:
        print(cluster.logs())  # shown by pytest when the test failed
        raise
    finally:
        api.close()
        db.conn.close()
    for host in cluster.hosts.values():
        # Files went to S3 only: no host wrote a local storage directory.
        assert not (host.dir / "local-storage").exists(), host.name
    print(f"multihost: the whole test took {time.monotonic() - started:.0f} s")


def registered_workers(redis_url: str) -> dict[str, list[Any]]:
    import redis
    from rq import Worker

    by_host: dict[str, list[Any]] = {}
    for worker in Worker.all(connection=redis.Redis.from_url(redis_url)):
        by_host.setdefault(worker.hostname, []).append(worker)
    return by_host


def run_the_batch(cluster: Cluster, db: Db, api: httpx.Client, *, victim: Host,
                  survivor: Host, web_alive: Any) -> None:
    redis_url = f"redis://{cluster.hosts['svc'].address}:6379/0"
    wait_for(lambda: {h: len(ws) for h, ws in registered_workers(redis_url).items()}
             == {"host-a": WORKERS_PER_HOST, "host-b": WORKERS_PER_HOST},
             timeout=180, every=0.5, message="every worker of both hosts registered")
    wait_for(lambda: web_alive() and _answers(api), timeout=60,
             message="the web host answering")

    upload = api.post("/v1/files", data={"purpose": "batch"}, files={"file": (
        "in.jsonl", jsonl([chat_line(f"r{i}", f"question {i}", max_tokens=8)
                           for i in range(REQUESTS)]))})
    assert upload.status_code == 200, upload.text
    created = api.post("/v1/batches", json={"input_file_id": upload.json()["id"],
                                            "endpoint": "/v1/chat/completions",
                                            "completion_window": "24h"})
    assert created.status_code == 200, created.text
    batch_id = created.json()["id"]
    submitted = time.monotonic()

    # Midway: a third of the shards done, and the victim running shards with progress.
    def midway() -> bool:
        shards = db.shards(batch_id)
        done = sum(s["status"] == "done" for s in shards)
        victim_busy = any(s["status"] == "running" and s["completed"] > 0
                          and host_of(s["worker"]) == victim.name for s in shards)
        return bool(shards) and done >= len(shards) // 3 and victim_busy

    wait_for(midway, timeout=240, every=0.2, message="the batch a third done")
    attempts, caught, killed = kill_holding_a_transaction(cluster, db, victim)
    killed_at = time.monotonic()
    # What the dead host held when it died: it can change no row any more.
    held = {s["index"] for s in db.shards(batch_id)
            if s["status"] == "running" and host_of(s["worker"]) == victim.name}
    done_before = sum(s["status"] == "done" for s in db.shards(batch_id))
    print(f"multihost: {victim.name} cut off and its {killed} processes killed "
          f"{killed_at - submitted:.0f} s after submitting (try {attempts}), holding shards "
          f"{sorted(held)} and {len(caught)} open transaction(s) {caught}; "
          f"{done_before} shards were done")
    assert killed >= WORKERS_PER_HOST and held

    # The sessions the dead host left inside a transaction hold row locks every other
    # worker needs; PostgreSQL's keepalive probes (BATCHWEB_DB_DEAD_CLIENT_SECONDS) find
    # the host gone and drop them.
    wait_for(lambda: not db.sessions(victim.address), timeout=60, every=0.5,
             message=f"PostgreSQL to drop {victim.name}'s sessions")
    print(f"multihost: PostgreSQL dropped {victim.name}'s sessions "
          f"{time.monotonic() - killed_at:.1f} s after the kill")

    # An operator sees the lost host at a glance: /metrics on the web host.
    def host_lost() -> dict:
        text = api.get("/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"}).text
        values = prometheus_values(text)
        lost = values.get(("batchweb_host_up", (("host", victim.name),))) == 0
        return lost and values

    values = wait_for(host_lost, timeout=60, every=0.5, message="/metrics to show the lost host")
    print(f"multihost: /metrics showed {victim.name} lost "
          f"{time.monotonic() - killed_at:.1f} s after the kill")
    assert values[("batchweb_host_up", (("host", survivor.name),))] == 1
    assert values[("batchweb_host_workers", (("host", victim.name), ("model", "echo-test"),
                                             ("state", "lost")))] == WORKERS_PER_HOST
    assert values[("batchweb_workers", (("model", "echo-test"),))] == WORKERS_PER_HOST

    def ended() -> dict:
        batch = api.get(f"/v1/batches/{batch_id}").json()
        return batch["status"] in ("completed", "failed", "expired", "cancelled") and batch

    try:
        batch = wait_for(ended, timeout=300, every=1, message="the batch to end")
    except AssertionError:
        raise AssertionError(f"batch not ended; shards: {db.shards(batch_id)}; database "
                             f"sessions: {db.sessions()}") from None
    print(f"multihost: batch ended {time.monotonic() - killed_at:.0f} s after the kill, "
          f"{time.monotonic() - submitted:.0f} s after submitting")
    assert batch["status"] == "completed", batch
    assert batch["request_counts"] == {"total": REQUESTS, "completed": REQUESTS, "failed": 0}

    # Every custom_id exactly once across the output and error files.
    ids = read_ids(api, batch["output_file_id"]) + read_ids(api, batch.get("error_file_id"))
    assert len(ids) == len(set(ids)), f"{len(ids) - len(set(ids))} custom_ids doubled"
    assert set(ids) == {f"r{i}" for i in range(REQUESTS)}, \
        f"{REQUESTS - len(set(ids))} custom_ids lost"

    # No shard is stuck: every one done, both hosts ran some, and the dead host's shards
    # were retried (the reconciler saw them go silent) and finished by the survivor.
    shards = db.shards(batch_id)
    assert len(shards) == REQUESTS // SHARD_SIZE
    assert all(s["status"] == "done" for s in shards), shards
    # The usage ledger charged each shard once, whichever host finished it.
    charged = db.rows("SELECT shard_id, count(*), sum(requests_succeeded) FROM "
                      "jobs_usagerecord WHERE batch_id = %s GROUP BY shard_id", batch_id)
    assert len(charged) == len(shards) and all(n == 1 for _, n, _ in charged), charged
    assert sum(requests for _, _, requests in charged) == REQUESTS
    by_host: dict[str, int] = {}
    for s in shards:
        by_host[host_of(s["worker"])] = by_host.get(host_of(s["worker"]), 0) + 1
    assert set(by_host) == {victim.name, survivor.name} and all(by_host.values()), by_host
    survivor_log = survivor.logs(tail=10**9)
    for s in shards:
        if s["index"] in held:
            assert host_of(s["worker"]) == survivor.name, s
            assert s["failures"] == 1 and s["attempt"] >= 2, s
            # The surviving host's reconciler is what handed it over.
            assert f"shard {s['id']} failed (worker lost (no heartbeat))" in survivor_log, s
        else:  # nothing else failed: the only fault was the dead host
            assert s["failures"] == 0, s
    print(f"multihost: {len(shards)} shards done: {by_host}; {len(held)} taken over from "
          f"{victim.name}, {sum(s['recomputed'] for s in shards)} requests computed again "
          f"(finished after their shard's last checkpoint)")


def kill_holding_a_transaction(cluster: Cluster, db: Db, victim: Host
                               ) -> tuple[int, list[tuple], int]:
    """Kill the victim host at the worst moment: while one of its database sessions is
    inside a transaction (holding row locks: a shard's, its batch's). The link is cut
    first; if no session of the host is then in a transaction, the link comes back a
    moment later (a blip TCP rides out) and the next moment is tried. Returns the tries,
    the sessions the dead host left in a transaction, and the processes killed."""
    for attempt in range(1, 400):
        cluster.cut(victim.name)
        time.sleep(0.02)  # what was in flight arrives, or is lost
        caught = [row for row in db.sessions(victim.address)
                  if row[1] == "idle in transaction"]
        if caught:
            return attempt, caught, victim.kill_all()
        cluster.cut(victim.name, down=False)
        time.sleep(random.uniform(0.02, 0.1))
    raise AssertionError(f"{victim.name} never held a transaction when its link was cut")


def _answers(api: httpx.Client) -> bool:
    try:
        return api.get("/v1/models").status_code == 200
    except httpx.HTTPError:
        return False


def read_ids(api: httpx.Client, file_id: str | None) -> list[str]:
    """The custom_ids of a stored file, streamed line by line from the web host."""
    if not file_id:
        return []
    ids = []
    with api.stream("GET", f"/v1/files/{file_id}/content") as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.strip():
                ids.append(json.loads(line)["custom_id"])
    return ids
