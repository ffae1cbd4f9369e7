"""Fault tests (minutes each): real worker processes killed, Redis stopped and flushed,
PostgreSQL backends terminated, the web process killed mid-upload, a full disk.

They run only with BATCHWEB_CHAOS=1 (`make chaos`); `make test` reports them skipped. Each
test gets a private redis-server on a free port (never the machine's shared Redis, which
they stop and flush), its own storage and scratch directories, and worker processes with
the test's environment."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.reliability_support import use_private_storage

CHAOS = os.environ.get("BATCHWEB_CHAOS") == "1"


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    if CHAOS:
        return
    skip = pytest.mark.skip(reason="fault tests: run with `make chaos` (BATCHWEB_CHAOS=1)")
    for item in items:
        if "chaos" in item.keywords:
            item.add_marker(skip)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PrivateRedis:
    """A redis-server of the test's own, without persistence, that can be stopped (its
    data is then gone, as after a crash) and started again on the same port."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server is not installed")
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if self.client().ping():
                    return
            except Exception:
                time.sleep(0.05)
        raise RuntimeError("private redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def client(self) -> Any:
        import redis

        return redis.Redis.from_url(self.url, socket_timeout=5)


@pytest.fixture
def private_redis(tmp_path: Path, monkeypatch: Any) -> Iterator[PrivateRedis]:
    from jobs import queues

    server = PrivateRedis(tmp_path)
    server.start()
    # This process (validation, enqueueing) talks to the private server too.
    monkeypatch.setattr(queues, "connection", server.client)
    yield server
    server.stop()


@pytest.fixture
def chaos_env(settings: Any, tmp_path: Path, private_redis: PrivateRedis) -> dict[str, str]:
    """The environment of this test's worker processes: the test database (added by
    Workers), the private Redis, storage and scratch dirs shared with this process."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    storage = use_private_storage(settings, tmp_path / "shared")
    return {"REDIS_URL": private_redis.url, "BATCHWEB_STORAGE_DIR": str(storage),
            "BATCHWEB_TMP_DIR": str(tmp_path / "shared" / "tmp"),
            "BATCHWEB_CLEANUP_INTERVAL_SECONDS": "0", "LOG_LEVEL": "WARNING"}


def read_lines(file_id: str | None) -> list[dict]:
    from django.core.files.storage import default_storage

    from jobs.models import File

    if file_id is None:
        return []
    file = File.objects.get(pk=file_id)
    with default_storage.open(file.storage_name, "rb") as handle:
        data = handle.read()
    assert len(data) == file.bytes
    return [json.loads(line) for line in data.splitlines()]


def assert_every_custom_id_once(batch: Any, expected: set[str]) -> tuple[list, list]:
    out, err = read_lines(batch.output_file_id), read_lines(batch.error_file_id)
    ids = [r["custom_id"] for r in out + err]
    assert len(ids) == len(set(ids)), f"{len(ids) - len(set(ids))} custom_ids doubled"
    assert set(ids) == expected, f"{len(expected - set(ids))} custom_ids lost"
    return out, err
