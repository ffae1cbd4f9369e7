"""Shared fixtures: users and keys, the official openai client against a live server, a real
Redis (flushed per test) and real `batchworker` processes on the test database."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Read by settings at import: the echo model for pipeline tests, short timings so the
# reconciler and heartbeats act within a test's patience, and a storage of the tests' own.
ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("BATCHWEB_ECHO_MODEL", "1")
# Live-server threads must not keep connections open, or the test database cannot be dropped.
os.environ.setdefault("DB_CONN_MAX_AGE", "0")
os.environ.setdefault("BATCHWEB_HEARTBEAT_SECONDS", "1")
os.environ.setdefault("BATCHWEB_HEARTBEAT_TIMEOUT_SECONDS", "6")
os.environ.setdefault("BATCHWEB_RECONCILE_SECONDS", "2")
os.environ.setdefault("BATCHWEB_SHARD_RETRY_BASE_SECONDS", "1")
os.environ.setdefault("BATCHWEB_STORAGE_DIR", str(ROOT / "var" / "test-storage"))

import pytest  # noqa: E402

from tests.helpers import Workers  # noqa: E402

EPOCH = time.time()


@pytest.fixture(autouse=True)
def _clean_redis() -> Iterator[None]:
    from jobs import queues

    queues.connection().flushdb()
    yield


@pytest.fixture
def user(django_user_model: Any) -> Any:
    return django_user_model.objects.create_user("alice", password="pw-alice-123")


@pytest.fixture
def other_user(django_user_model: Any) -> Any:
    return django_user_model.objects.create_user("bob", password="pw-bob-123")


@pytest.fixture
def api_key(user: Any) -> str:
    from jobs.services.keys import create_api_key

    return create_api_key(owner=user, name="test")[1]


@pytest.fixture
def other_key(other_user: Any) -> str:
    from jobs.services.keys import create_api_key

    return create_api_key(owner=other_user, name="test")[1]


@pytest.fixture
def openai_client(live_server: Any, api_key: str) -> Any:
    import openai

    return openai.OpenAI(base_url=live_server.url + "/v1", api_key=api_key, max_retries=0)


@pytest.fixture
def other_client(live_server: Any, other_key: str) -> Any:
    import openai

    return openai.OpenAI(base_url=live_server.url + "/v1", api_key=other_key, max_retries=0)


@pytest.fixture
def workers(transactional_db: Any, tmp_path: Path) -> Iterator[Workers]:
    pool = Workers(tmp_path)
    yield pool
    pool.stop_all()
