"""A deployment of one release's tree, as an operator runs it, for the upgrade and restore
tests: its own database (a scratch PostgreSQL database, or an SQLite file), a private
redis-server, its storage (a local folder, or an S3 bucket), and real processes started from
the tree: `manage.py migrate`, Granian, `controlworker`, `batchworker` on the echo model.
Stopping a process is what a rolling update does: SIGTERM, then SIGKILL after the grace
period (counted, so a test can say nothing was killed).

The processes read tests/settings.py of their tree (the echo model, short heartbeats); the
test reads the database itself (psycopg or sqlite3), never through this process's Django
connection, which stays on the suite's test database."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest

from tests.factories import PrivateRedis, engine_request_log, free_port, wait_for

# The worker's drain on SIGTERM and the grace period after it, shortened in proportion to
# the defaults (60 s drain, 120 s grace: deploy/k8s) so a test does not wait minutes.
DRAIN_SECONDS = 3
GRACE_SECONDS = 30


def server_url() -> str:
    """The PostgreSQL server of the suite's DATABASE_URL (its maintenance database)."""
    url = os.environ.get("DATABASE_URL", "")
    if not url.startswith(("postgres://", "postgresql://")):
        pytest.skip("needs PostgreSQL: run with a postgres:// DATABASE_URL")
    return urlunsplit(urlsplit(url)._replace(path="/postgres"))


def _admin(sql: str) -> None:
    import psycopg

    with psycopg.connect(server_url(), autocommit=True) as conn:
        conn.execute(sql)


@contextlib.contextmanager
def scratch_database(label: str) -> Iterator[str]:
    """A new, empty PostgreSQL database (dropped afterwards, its connections ended); yields
    its URL. Named after the suite's database, so parallel runs never share one."""
    base = urlsplit(os.environ["DATABASE_URL"]).path.strip("/") or "batchweb"
    name = re.sub(r"\W", "_", f"{base}_{label}_{os.getpid()}")[:63]
    _admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    _admin(f'CREATE DATABASE "{name}"')
    try:
        yield urlunsplit(urlsplit(server_url())._replace(path=f"/{name}"))
    finally:
        _admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@dataclass
class Stack:
    """One release's processes on one deployment's services."""

    tree: Path
    database_url: str
    redis: PrivateRedis
    storage_env: dict[str, str]  # BATCHWEB_STORAGE_DIR, or the S3 settings
    workdir: Path
    env_extra: dict[str, str] = field(default_factory=dict)
    procs: list[subprocess.Popen] = field(default_factory=list)
    killed: int = 0  # processes still running at the end of their grace period
    port: int = field(default_factory=free_port)

    @property
    def request_log(self) -> Path:
        return self.workdir / "engine-requests.log"

    @property
    def env(self) -> dict[str, str]:
        (self.workdir / "tmp").mkdir(parents=True, exist_ok=True)
        # Not this test process's xdist share (tests/settings.py would move Redis and
        # storage for it): the deployment's own services.
        inherited = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
        return {**inherited, "DJANGO_SETTINGS_MODULE": "tests.settings",
                "DATABASE_URL": self.database_url, "REDIS_URL": self.redis.url,
                "BATCHWEB_TMP_DIR": str(self.workdir / "tmp"),
                "BATCHWEB_ENGINE_MODE": "eager", "BATCHWEB_CLEANUP_INTERVAL_SECONDS": "0",
                "BATCHWEB_ECHO_REQUEST_LOG": str(self.request_log), "LOG_LEVEL": "WARNING",
                # The tree's own packages first (not this checkout's editable install).
                "PYTHONPATH": str(self.tree), **self.storage_env, **self.env_extra}

    def manage(self, *args: str) -> str:
        done = subprocess.run([sys.executable, "manage.py", *args], cwd=self.tree,
                              env=self.env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"manage.py {' '.join(args)}:\n{done.stdout}{done.stderr}"
        return done.stdout

    def api_key(self) -> str:
        """A user and its API key, as `make run` makes them (`manage.py demouser`)."""
        return self.demo_user()[1]

    def demo_user(self) -> tuple[str, str]:
        """`manage.py demouser`: the user `demo`'s new password and a new API key."""
        out = self.manage("demouser")
        return out.split("login:")[1].split()[2], out.split("API key:")[1].split()[0]

    def signed_in(self, password: str) -> Any:
        """An HTTP client signed in to the dashboard as `demo` (its session cookie)."""
        import httpx

        browser = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=30)
        page = browser.get("/accounts/login/").text
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page)
        assert token, page[:500]
        done = browser.post("/accounts/login/", data={
            "username": "demo", "password": password, "csrfmiddlewaretoken": token.group(1)})
        assert done.status_code == 302, done.text[:500]
        return browser

    def _spawn(self, name: str, command: list[str]) -> subprocess.Popen:
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(self.workdir / f"{len(self.procs):02d}-{name}.log", "wb") as log:
            proc = subprocess.Popen(command, cwd=self.tree, env=self.env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def web(self) -> subprocess.Popen:
        """Granian as `runservice` and the image run it (the tree's own web_server), with
        2 worker processes; returns once both have loaded the application. Another web
        server may listen on the same port (Granian's sockets share it, SO_REUSEPORT), as
        two pods behind one Service do during a rollout."""
        code = ("import sys, os; from jobs.management.commands.runservice import web_server; "
                "os.execv(sys.executable, web_server(sys.argv[1], 2))")
        proc = self._spawn("web", [sys.executable, "-c", code, f"127.0.0.1:{self.port}"])
        log = self.workdir / f"{len(self.procs) - 1:02d}-web.log"

        def started() -> bool:
            assert proc.poll() is None, f"the web server exited:\n{log.read_text()}"
            return log.read_text(errors="replace").count("Started worker") >= 2

        wait_for(started, timeout=90, message="Granian's workers started")
        wait_for(lambda: _listens(self.port), timeout=30, message="Granian listening")
        return proc

    def worker(self, *, name: str = "") -> subprocess.Popen:
        return self._spawn("worker", [sys.executable, "manage.py", "batchworker", "--model",
                                      "echo-test", "--drain-seconds", str(DRAIN_SECONDS),
                                      *(["--name", name] if name else [])])

    def control(self) -> subprocess.Popen:
        return self._spawn("control", [sys.executable, "manage.py", "controlworker"])

    def stop(self, proc: subprocess.Popen, *, grace: float = GRACE_SECONDS) -> None:
        """SIGTERM, then SIGKILL of its whole group after `grace` seconds."""
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.killed += 1
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # Granian's workers outlive a killed master
        proc.wait()

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            self.stop(proc)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n" + p.read_text(errors="replace")[-3000:]
                         for p in sorted(self.workdir.glob("*.log"))
                         if p != self.request_log)

    def computed(self) -> dict[tuple[str, int], int]:
        """(shard, input line) -> how often this deployment's engines computed it."""
        return engine_request_log(self.request_log)

    def openai(self, key: str, **options: Any) -> Any:
        import openai

        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=key,
                             **options)

    # --- the database, read as the processes wrote it ---

    def query(self, sql: str, *params: Any) -> list[tuple]:
        if self.database_url.startswith("sqlite:"):
            with contextlib.closing(sqlite3.connect(self.database_url[len("sqlite:///"):],
                                                    timeout=30)) as conn:
                return conn.execute(sql.replace("%s", "?"), params).fetchall()
        import psycopg

        with psycopg.connect(self.database_url) as conn:
            return conn.execute(sql, params).fetchall()


def _listens(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


# --- the figures each test prints (and `make test`'s summary repeats) ---

FIGURES: list[str] = []


def report(line: str) -> None:
    print(line)
    FIGURES.append(line)


# --- what a batch's rows say ---


def checkpointed(stack: Stack, batch_id: str) -> set[tuple[str, int]]:
    """(shard, input line) of every result saved: the lines of done shards and those of
    running shards' checkpoints."""
    saved: set[tuple[str, int]] = set()
    for shard_id, status, first, count, checkpoint in stack.query(
            "SELECT id, status, first_line, request_count, checkpoint FROM jobs_shard "
            "WHERE batch_id = %s", batch_id):
        if status == "done":
            saved.update((shard_id, line) for line in range(first, first + count))
            continue
        value = json.loads(checkpoint) if isinstance(checkpoint, str) else checkpoint
        for low, high in (value or {}).get("lines", ()):
            saved.update((shard_id, line) for line in range(low, high + 1))
    return saved


def ledger(stack: Stack, batch_id: str) -> dict[str, Any]:
    """The usage ledger of a batch against its done shards."""
    records = stack.query("SELECT shard_id, requests_succeeded, input_tokens, output_tokens "
                          "FROM jobs_usagerecord WHERE batch_id = %s", batch_id)
    done = {row[0] for row in stack.query(
        "SELECT id FROM jobs_shard WHERE batch_id = %s AND status = 'done'", batch_id)}
    shards = [row[0] for row in records]
    return {"charged_twice": len(shards) - len(set(shards)),
            "never_charged": len(done - set(shards)),
            "requests": sum(row[1] for row in records),
            "input_tokens": sum(row[2] for row in records),
            "output_tokens": sum(row[3] for row in records)}


def results(client: Any, batch: Any) -> list[dict]:
    """The output and error lines of an ended batch, through the API."""
    lines = []
    for file_id in (batch.output_file_id, batch.error_file_id):
        if file_id:
            lines += [json.loads(line) for line in
                      client.files.content(file_id).text.splitlines() if line.strip()]
    return lines


def figures(lines: list[dict], expected: set[str]) -> dict[str, int]:
    ids = [line["custom_id"] for line in lines]
    return {"lost": len(expected - set(ids)), "duplicated": len(ids) - len(set(ids)),
            "unexpected": len(set(ids) - expected)}


def wait_ended(client: Any, batch_id: str, *, timeout: float, stack: Stack) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        time.sleep(1)
    raise AssertionError(f"batch {batch_id} not ended after {timeout}s\n{stack.logs()}")
