"""Fault tests (minutes each): real worker processes killed, Redis stopped and flushed,
PostgreSQL backends terminated, the web process killed mid-upload, a full disk.

They run only with BATCHWEB_CHAOS=1 (`make chaos`); `make test` reports them skipped. Each
test gets a private redis-server on a free port (never the machine's shared Redis, which
they stop and flush), its own storage and scratch directories, and worker processes with
the test's environment."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.factories import PrivateRedis, use_private_storage

CHAOS = os.environ.get("BATCHWEB_CHAOS") == "1"


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    if CHAOS:
        return
    skip = pytest.mark.skip(reason="fault tests: run with `make chaos` (BATCHWEB_CHAOS=1)")
    for item in items:
        if "chaos" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def private_redis(tmp_path: Path, monkeypatch: Any) -> Iterator[PrivateRedis]:
    from jobs.lib import queues

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
    storage = use_private_storage(settings, tmp_path / "shared")
    return {"REDIS_URL": private_redis.url, "BATCHWEB_STORAGE_DIR": str(storage),
            "BATCHWEB_TMP_DIR": str(tmp_path / "shared" / "tmp"),
            "BATCHWEB_CLEANUP_INTERVAL_SECONDS": "0", "LOG_LEVEL": "WARNING"}


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Any]:
    """Four hosts on a private bridge (tests/chaos/cluster.py): `svc` (PostgreSQL, Redis,
    S3), `web`, and the worker hosts `host-a` and `host-b`. Every process, namespace and
    link is taken down afterwards, whatever happened."""
    from tests.chaos.cluster import Cluster, namespaces_work, postgres_bin

    why = namespaces_work()
    if why:
        pytest.skip(f"network namespaces cannot be made here: {why}")
    if postgres_bin() is None:
        pytest.skip("PostgreSQL's server binaries (/usr/lib/postgresql/*/bin) are missing")
    hosts = Cluster(tmp_path / "hosts")
    try:
        hosts.build(["svc", "web", "host-a", "host-b"])
        yield hosts
    finally:
        hosts.close()
