"""Faults survived: nothing lost, nothing doubled. Run with `make chaos` (minutes)."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.core.files.storage import default_storage
from django.db import connection
from django.db.models import Sum
from django.utils import timezone

from jobs.management.commands.runservice import web_server
from jobs.models import Batch, File, Shard
from jobs.services.batches import create_batch
from jobs.services.files import create_input_file
from jobs.services.validation import run_validation
from tests.factories import (
    ROOT,
    PrivateRedis,
    Workers,
    assert_charged_once,
    assert_every_custom_id_once,
    chat_line,
    database_url,
    free_port,
    jsonl,
    storage_snapshot,
    wait_for,
)

pytestmark = [pytest.mark.chaos, pytest.mark.django_db(transaction=True)]

SEED = int(os.environ.get("BATCHWEB_CHAOS_SEED", "7"))


def submit(user: Any, n: int, tmp_path: Path, settings: Any, *, shard_size: int,
           prefix: str = "r") -> Batch:
    settings.BATCHWEB = {**settings.BATCHWEB, "SHARD_SIZE": shard_size}
    path = tmp_path / f"{prefix}-input.jsonl"
    path.write_bytes(jsonl([chat_line(f"{prefix}{i}", f"question {i}", max_tokens=8)
                            for i in range(n)]))
    file = create_input_file(owner=user, path=path, filename="in.jsonl", purpose="batch")
    batch = create_batch(owner=user, input_file_id=file.pk, endpoint="/v1/chat/completions",
                         completion_window="24h")
    run_validation(batch_id=batch.pk)
    batch = Batch.objects.get(pk=batch.pk)
    assert batch.status == "in_progress" and batch.total == n
    return batch


class Supervisor:
    """Worker processes kept at a count, restarted when they exit (as `runservice` or a
    process manager does)."""

    def __init__(self, workers: Workers, env: dict[str, str], count: int) -> None:
        self.workers = workers
        self.env = env
        self.procs = [workers.start(env=env) for _ in range(count)]
        self.restarts = 0

    def tick(self) -> None:
        for i, proc in enumerate(self.procs):
            if proc.poll() is not None:
                self.procs[i] = self.workers.start(env=self.env)
                self.restarts += 1

    def kill(self, proc: subprocess.Popen) -> None:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        self.procs[self.procs.index(proc)] = self.workers.start(env=self.env)

    def taking_jobs(self) -> list[subprocess.Popen]:
        """The workers up and registered with RQ. A replacement spends seconds starting
        Python, Django and its engine (many more on a busy machine): killing it then would
        only interrupt an import, never a shard."""
        from rq import Worker

        from jobs.lib import queues

        pids = {w.pid for w in Worker.all(connection=queues.connection())}
        return [p for p in self.procs if p.poll() is None and p.pid in pids]


def unfinished(batch: Batch) -> bool:
    return Shard.objects.filter(batch_id=batch.pk, status__in=("queued", "running")).exists()


def wait_ended(batch: Batch, *, timeout: float, tick: Callable[[], None] = lambda: None
               ) -> Batch:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        tick()
        current = Batch.objects.get(pk=batch.pk)
        if current.is_ended:
            return current
        time.sleep(0.5)
    shards = list(Shard.objects.filter(batch_id=batch.pk).values_list(
        "index", "status", "attempt", "failures", "last_error"))
    raise AssertionError(f"batch still {Batch.objects.get(pk=batch.pk).status}: {shards}")


def failures(batch: Batch) -> int:
    return Shard.objects.filter(batch_id=batch.pk).aggregate(n=Sum("failures"))["n"] or 0


# --- workers SIGKILLed ---


def test_workers_sigkilled_20_times_lose_and_double_nothing(user, chaos_env, workers, settings,
                                                            tmp_path):
    n = 2400
    batch = submit(user, n, tmp_path, settings, shard_size=100)
    env = {**chaos_env, "BATCHWEB_ECHO_SECONDS": "0.12", "BATCHWEB_ECHO_MAX_IN_FLIGHT": "4",
           "BATCHWEB_SHARD_MAX_ATTEMPTS": "100"}
    pool = Supervisor(workers, env, 2)
    rng = random.Random(SEED)
    wait_for(lambda: Shard.objects.filter(batch_id=batch.pk, completed__gt=0).exists(),
             timeout=60, message="first progress")
    kills = 0
    started = time.monotonic()
    while kills < 24 and unfinished(batch):
        # A random moment of a working worker's life: 1-4 s after it was taking jobs.
        up = wait_for(pool.taking_jobs, timeout=120, message="a worker taking jobs")
        time.sleep(rng.uniform(1.0, 4.0))
        pool.kill(rng.choice(up))
        kills += 1
    killing = time.monotonic() - started
    shards = Shard.objects.filter(batch_id=batch.pk)
    done = f"{shards.filter(status='done').count()}/{shards.count()} shards done"
    print(f"chaos: {kills} SIGKILLs in {killing:.0f}s ({done}), seed {SEED}")
    assert kills >= 20, f"the batch finished after only {kills} kills: make it longer"
    batch = wait_ended(batch, timeout=600, tick=pool.tick)
    assert batch.status == "completed"
    out, err = assert_every_custom_id_once(batch, {f"r{i}" for i in range(n)})
    assert len(out) == n and err == []
    assert batch.to_openai()["request_counts"] == {"total": n, "completed": n, "failed": 0}
    assert_charged_once(batch.pk, out)
    assert failures(batch) >= 10  # the kills did hit running shards
    print(f"chaos: kills={kills} shard failures={failures(batch)} restarts={pool.restarts} "
          f"batch ended {time.monotonic() - started:.0f}s after the kills began")


def test_vllm_worker_sigkilled_mid_shard_loses_nothing_and_leaves_no_engine(
        user, chaos_env, workers, settings, tmp_path):
    """The same fault with the real engine: a worker whose vLLM engine core (a child
    process holding the model and KV cache) is generating is SIGKILLed. Its engine core
    must not outlive it, holding memory, and a new worker must finish the batch with
    every request once."""
    import psutil

    model = "SmolLM2-135M-Instruct"
    # Shards of a few seconds each, their progress written every second: the kill lands
    # while one is generating (a shard shorter than a heartbeat never shows progress).
    settings.BATCHWEB = {**settings.BATCHWEB, "SHARD_SIZE": 16}
    n = 64
    path = tmp_path / "input.jsonl"
    path.write_bytes(jsonl([chat_line(f"r{i}", f"Write a short poem about the number {i}.",
                                      model=model, max_tokens=64, temperature=0)
                            for i in range(n)]))
    file = create_input_file(owner=user, path=path, filename="in.jsonl", purpose="batch")
    batch = create_batch(owner=user, input_file_id=file.pk, endpoint="/v1/chat/completions",
                         completion_window="24h")
    run_validation(batch_id=batch.pk)
    env = {**chaos_env, "BATCHWEB_DTYPE": "float32", "VLLM_CPU_KVCACHE_SPACE": "1",
           "BATCHWEB_HEARTBEAT_SECONDS": "1", "BATCHWEB_HEARTBEAT_TIMEOUT_SECONDS": "10"}
    worker = workers.start(model, env=env)
    wait_for(lambda: Shard.objects.filter(batch_id=batch.pk, status="running",
                                          completed__gt=0).exists(),
             timeout=600, every=0.5, message="the vLLM worker generating")
    tree = [worker.pid, *(c.pid for c in psutil.Process(worker.pid).children(recursive=True))]
    assert len(tree) > 1, "the engine core runs in a child process"
    worker.send_signal(signal.SIGKILL)
    worker.wait()

    def engine_gone() -> bool:
        return not any(psutil.pid_exists(pid) and psutil.Process(pid).status() !=
                       psutil.STATUS_ZOMBIE for pid in tree)

    wait_for(engine_gone, timeout=60, every=0.5, message="the orphaned engine core to exit")
    workers.start(model, env=env)
    batch = wait_ended(Batch.objects.get(pk=batch.pk), timeout=900)
    assert batch.status == "completed"
    out, err = assert_every_custom_id_once(batch, {f"r{i}" for i in range(n)})
    assert len(out) == n and err == []
    assert_charged_once(batch.pk, out)
    assert failures(batch) >= 1  # the kill hit a running shard, which ran again
    assert all(r["response"]["status_code"] == 200 and
               r["response"]["body"]["choices"][0]["message"]["content"] for r in out)


# --- Redis stopped, started, flushed ---


def test_redis_stopped_and_started_mid_batch(user, chaos_env, workers, settings, tmp_path,
                                             private_redis: PrivateRedis):
    n = 2000
    batch = submit(user, n, tmp_path, settings, shard_size=50)
    env = {**chaos_env, "BATCHWEB_ECHO_SECONDS": "0.05", "BATCHWEB_ECHO_MAX_IN_FLIGHT": "4"}
    pool = Supervisor(workers, env, 2)
    for _ in range(2):
        wait_for(lambda: Shard.objects.filter(batch_id=batch.pk, status="done").count() >= 3,
                 timeout=120, message="some finished shards")
        private_redis.stop()
        time.sleep(5)  # workers, heartbeats and reconcilers run into a dead Redis
        private_redis.start()  # empty: every queued job is gone
        time.sleep(3)
    batch = wait_ended(batch, timeout=300, tick=pool.tick)
    assert batch.status == "completed"
    out, err = assert_every_custom_id_once(batch, {f"r{i}" for i in range(n)})
    assert len(out) == n
    print(f"chaos: redis stopped twice; worker restarts={pool.restarts}")


def test_redis_flushed_repeatedly_mid_batch(user, chaos_env, workers, settings, tmp_path,
                                            private_redis: PrivateRedis):
    n = 2000
    batch = submit(user, n, tmp_path, settings, shard_size=50)
    env = {**chaos_env, "BATCHWEB_ECHO_SECONDS": "0.05", "BATCHWEB_ECHO_MAX_IN_FLIGHT": "4"}
    pool = Supervisor(workers, env, 2)
    flushes = 0
    while flushes < 6 and unfinished(batch):
        time.sleep(2.5)
        private_redis.client().flushall()
        flushes += 1
    assert flushes >= 4
    batch = wait_ended(batch, timeout=300, tick=pool.tick)
    assert batch.status == "completed"
    out, _ = assert_every_custom_id_once(batch, {f"r{i}" for i in range(n)})
    assert len(out) == n
    print(f"chaos: {flushes} flushes; worker restarts={pool.restarts}")


# --- PostgreSQL connections dropped ---


def test_postgres_backends_terminated_mid_batch(user, chaos_env, workers, settings, tmp_path):
    if connection.vendor != "postgresql":
        pytest.skip("needs PostgreSQL (DATABASE_URL)")
    n = 2000
    batch = submit(user, n, tmp_path, settings, shard_size=50)
    env = {**chaos_env, "BATCHWEB_ECHO_SECONDS": "0.05", "BATCHWEB_ECHO_MAX_IN_FLIGHT": "4",
           "BATCHWEB_SHARD_MAX_ATTEMPTS": "50"}
    pool = Supervisor(workers, env, 2)
    wait_for(lambda: Shard.objects.filter(batch_id=batch.pk, status="done").exists(),
             timeout=120, message="a finished shard")
    terminated = 0
    rounds = 0
    while rounds < 8 and unfinished(batch):
        time.sleep(2)
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                           "WHERE datname = current_database() AND pid <> pg_backend_pid()")
            terminated += cursor.fetchone()[0]
        rounds += 1
    assert terminated >= 8, terminated
    batch = wait_ended(batch, timeout=300, tick=pool.tick)
    assert batch.status == "completed"
    out, err = assert_every_custom_id_once(batch, {f"r{i}" for i in range(n)})
    assert len(out) == n and err == []
    # A finish retried after its commit's answer was lost charged nothing twice.
    assert_charged_once(batch.pk, out)
    # The workers reconnected: none had to be restarted.
    assert pool.restarts == 0, workers.logs()
    print(f"chaos: {terminated} backends terminated in {rounds} rounds")


# --- the web process killed during uploads ---


def _multipart(key: str, body: bytes, port: int) -> tuple[bytes, bytes]:
    boundary = "chaosboundary"
    payload = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\n"
               f"batch\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
               f"filename=\"big.jsonl\"\r\nContent-Type: application/jsonl\r\n\r\n"
               ).encode() + body + f"\r\n--{boundary}--\r\n".encode()
    head = (f"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Authorization: Bearer {key}\r\nContent-Length: {len(payload)}\r\n"
            f"Content-Type: multipart/form-data; boundary={boundary}\r\n\r\n").encode()
    return head, payload


def _listens(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _web_worker(master: subprocess.Popen) -> int:
    def child() -> int | None:
        out = subprocess.run(["pgrep", "-P", str(master.pid)], capture_output=True, text=True)
        pids = out.stdout.split()
        return int(pids[0]) if pids else None

    return wait_for(child, timeout=30, message="a Granian worker")


def test_web_killed_during_uploads_leaves_no_half_file(user, chaos_env, tmp_path, settings):
    from jobs.services.cleanup import run_cleanup
    from jobs.services.keys import create_api_key

    key = create_api_key(owner=user, name="k")[1]
    port = free_port()
    env = {**os.environ, **chaos_env, "DATABASE_URL": database_url(),
           "DJANGO_SETTINGS_MODULE": "tests.settings"}
    # The web server as runservice starts it, with one worker process.
    with open(tmp_path / "granian.log", "wb") as log:
        master = subprocess.Popen(web_server(f"127.0.0.1:{port}", 1), env=env, cwd=ROOT,
                                  stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    try:
        wait_for(lambda: _listens(port), timeout=30, message="Granian")
        body = jsonl([chat_line(f"u{i}", "x" * 200) for i in range(40_000)])  # ~12 MB
        head, payload = _multipart(key, body, port)
        rng = random.Random(SEED)
        for round_ in range(10):
            worker = _web_worker(master)
            # Kill while the body arrives, or just after it all arrived (scan, store).
            cut = rng.choice([0.05, 0.3, 0.6, 0.95, 1.0, 1.0])
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.sendall(head)
                sent = 0
                target = int(len(payload) * cut)
                while sent < target:
                    chunk = payload[sent:min(target, sent + 256 * 1024)]
                    sock.sendall(chunk)
                    sent += len(chunk)
                if cut == 1.0:  # during the scan, the store, or after the File exists
                    time.sleep(rng.choice([0.2, 0.8, 1.5, 3.0, 6.0]))
                os.kill(worker, signal.SIGKILL)
                killed = time.monotonic()
            wait_for(lambda w=worker: _web_worker(master) != w, timeout=30,
                     message="Granian to replace its worker")
            # Each Granian worker listens on the port itself (SO_REUSEPORT): until the new
            # one does, the only one here, connections are refused.
            wait_for(lambda: _listens(port), timeout=60, message="the new worker listening")
            print(f"chaos: upload round {round_} killed at {cut:.0%}")
            # Granian takes a worker that dies within 5.5 s of being respawned for a crash
            # loop and exits: the next kill comes later than that.
            time.sleep(max(0.0, killed + 6 - time.monotonic()))
        # The same upload, not interrupted, is stored whole (the control).
        import httpx

        control = httpx.post(f"http://127.0.0.1:{port}/v1/files", timeout=120,
                             headers={"Authorization": f"Bearer {key}"},
                             files={"file": ("big.jsonl", body)}, data={"purpose": "batch"})
        assert control.status_code == 200, control.text
        assert File.objects.filter(pk=control.json()["id"]).exists()
        # Every File visible is whole: its content is all there and hashes right.
        for file in File.objects.all():
            with default_storage.open(file.storage_name, "rb") as handle:
                data = handle.read()
            assert len(data) == file.bytes and hashlib.sha256(data).hexdigest() == file.sha256
            assert data == body  # only whole uploads ever became Files
        rows = set(File.objects.values_list("storage_name", flat=True))
        leftovers = {name for name in storage_snapshot(Path(default_storage.location))
                     if name not in rows}
        print(f"chaos: {File.objects.count()} whole files, storage leftovers {sorted(leftovers)}")
        # Leftovers in storage are unreferenced objects under files/: cleanup's orphans.
        assert all(name.startswith("files/") for name in leftovers), leftovers
        report = run_cleanup(now=timezone.now() + timedelta(days=1))
        assert set(report.orphans) >= leftovers
        remaining = set(storage_snapshot(Path(default_storage.location)))
        assert remaining == rows
        # The killed processes' scratch files (Django's upload temp files) are swept too.
        print(f"chaos: scratch leftovers swept: {len(report.temp_files)}")
        assert list(Path(chaos_env["BATCHWEB_TMP_DIR"]).iterdir()) == []
    finally:
        master.send_signal(signal.SIGTERM)
        try:
            master.wait(timeout=40)
        except subprocess.TimeoutExpired:
            os.killpg(master.pid, signal.SIGKILL)  # its workers too
            master.wait()


# --- the disk fills up while results are stored ---


def test_disk_full_while_storing_results_fails_and_retries_the_shard(user, chaos_env, workers,
                                                                     settings, tmp_path):
    # Workers hold results in memory and store them as checkpoint segments and parts under
    # parts/: that is the directory that fills up.
    disk = Path(chaos_env["BATCHWEB_STORAGE_DIR"]) / "parts"
    disk.mkdir(parents=True, exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs (needs root)")
    try:
        filler = disk / "filler"
        with open(filler, "wb") as handle:  # leave ~8 kB free
            handle.write(b"\0" * (1024 * 1024 - 8 * 1024))
        n = 600
        batch = submit(user, n, tmp_path, settings, shard_size=100)
        env = {**chaos_env, "BATCHWEB_ECHO_SECONDS": "0.01",
               "BATCHWEB_ECHO_MAX_IN_FLIGHT": "8", "BATCHWEB_SHARD_MAX_ATTEMPTS": "50"}
        pool = Supervisor(workers, env, 1)
        wait_for(lambda: failures(batch) >= 3, timeout=120, message="shards failing on ENOSPC")
        errors = set(Shard.objects.filter(batch_id=batch.pk).exclude(last_error="")
                     .values_list("last_error", flat=True))
        assert any("No space left" in e for e in errors), errors
        assert not Shard.objects.filter(batch_id=batch.pk, status="done").exclude(
            output_part="").filter(failures=0, attempt__gt=1).exists()
        filler.unlink()  # the operator frees space: the retries go through
        batch = wait_ended(batch, timeout=300, tick=pool.tick)
        assert batch.status == "completed"
        out, err = assert_every_custom_id_once(batch, {f"r{i}" for i in range(n)})
        assert len(out) == n and err == []
        assert all(r["response"]["status_code"] == 200 for r in out)
        assert pool.restarts == 0  # the worker itself survived the full disk
        print(f"chaos: disk full -> {failures(batch)} shard failures, then completed")
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
