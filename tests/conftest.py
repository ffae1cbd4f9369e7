"""Shared fixtures: users and keys, the official openai client against a live server, a real
Redis (flushed per test that may reach it), real `batchworker` processes on the test
database, and a webhook receiver on loopback with the settings that let the service call it.
And the quick tier (`make quick`, `-m quick`): the tests that touch no database, Redis,
process or server, marked here from the fixtures and markers they use."""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any

import pytest

from tests.factories import TLS_CONTEXT, Receiver, Workers

EPOCH = time.time()

# Fixtures that run workers (real processes, or the pipeline in this one): a test using one
# spends seconds waiting on them.
WORKER_FIXTURES = {"workers", "service", "gpu_host", "make_pipeline"}


# What keeps a test out of the quick tier: the database (pytest-django's marker and
# fixtures; a live server has one), a fixture that starts processes or servers (a module's
# own asks for `starts_processes`), a marker of a test that does so itself (`processes`) or
# talks to Redis itself (`redis`), or of a tier of its own; and tests/bench/, whose tests
# run the benchmarks as processes.
DATABASE_FIXTURES = {"db", "transactional_db", "django_db_reset_sequences",
                     "django_db_serialized_rollback", "live_server"}
PROCESS_FIXTURES = WORKER_FIXTURES | {"smol_server", "receiver", "starts_processes"}
NOT_QUICK_MARKERS = {"django_db", "processes", "redis", "engine", "models", "chaos",
                     "upgrade", "browser", "bench", "deploy"}
PROCESS_DIRS = {Path(__file__).parent / "bench"}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "quick: touches no database, Redis, process or server; set by "
        "tests/conftest.py from the fixtures and markers a test uses (`make quick`)")
    config.addinivalue_line(
        "markers", "processes: starts processes or servers itself (not through a "
        "fixture): not in the quick tier")
    config.addinivalue_line(
        "markers", "redis: talks to Redis itself, without the database: not in the quick "
        "tier, and Redis is flushed before it")


def is_quick(item: pytest.Item) -> bool:
    if any(mark.name in NOT_QUICK_MARKERS for mark in item.iter_markers()):
        return False
    if PROCESS_DIRS.intersection(item.path.parents):
        return False
    return not (DATABASE_FIXTURES | PROCESS_FIXTURES).intersection(
        getattr(item, "fixturenames", ()))


# What a quick test may not do; the audit hook below fails one that tries, so a test that
# needs any of it is told to say so (it would otherwise slow the tier, or leave Redis
# unflushed for the next test).
QUICK_FORBIDS = {
    "subprocess.Popen": "starts a process", "os.fork": "forks", "os.forkpty": "forks",
    "os.posix_spawn": "starts a process", "os.spawn": "starts a process",
    "os.exec": "runs a program", "os.system": "runs a program",
    "socket.bind": "opens a server socket", "socket.connect": "connects to a server"}
_quick_running: list[str] = []  # the quick test being set up, run or torn down, if any


def _quick_guard(event: str, args: tuple[Any, ...]) -> None:
    # The test's own thread only: a thread left by an earlier test is that test's.
    if (_quick_running and event in QUICK_FORBIDS
            and threading.current_thread() is threading.main_thread()):
        raise RuntimeError(
            f"{_quick_running[0]} is in the quick tier but {QUICK_FORBIDS[event]} "
            f"({event}{args[:2]!r}): give it the fixture that does so, or mark it "
            "`processes` (or `redis`; tests/conftest.py)")


sys.addaudithook(_quick_guard)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    quick = item.get_closest_marker("quick") is not None
    if quick:
        _quick_running.append(item.nodeid)
    try:
        return (yield)
    finally:
        if quick:
            _quick_running.clear()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the quick tier (`is_quick`). Then, under pytest-xdist (`make check`), give every
    process the same share of the tests that wait on workers, at the head of its share.

    Work stealing hands each process a contiguous slice of the collection and later moves
    tests from the end of a busy process's queue to an idle one. Left in file order, the
    slow tests bunch in the slices of a few modules and the run ends waiting on one process;
    at the heads of the slices they run first, while the quick tests behind them are still
    there to be stolen."""
    for item in items:
        if is_quick(item):
            item.add_marker(pytest.mark.quick)
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if count < 2:
        return
    slow: list[pytest.Item] = []
    rest: list[pytest.Item] = []
    for item in items:
        (slow if WORKER_FIXTURES.intersection(item.fixturenames) else rest).append(item)
    quick = iter(rest)
    shares = [slow[index::count] for index in range(count)]
    left = len(items)
    for index, share in enumerate(shares):
        size = left // (count - index)  # the scheduler's first split of what is left
        left -= size
        share.extend(islice(quick, max(0, size - len(share))))
    items[:] = [item for share in shares for item in share] + list(quick)


@pytest.fixture(scope="session")
def starts_processes() -> None:
    """Asked for by a fixture that starts processes or servers (or talks to Redis): the
    tests using it are not in the quick tier."""


@pytest.fixture(scope="session")
def django_db_setup(django_db_setup: None, django_db_blocker: Any) -> Iterator[None]:
    """The test database as pytest-django builds it, with a cheaper refill after each flush.

    A test on a live database (workers, a live server) ends with Django's `flush`, which
    empties every table, then sends `post_migrate` so the content types and permissions
    are created again: ~28 ms of queries per test, ~9 s of the fast tier's CPU. Their rows
    never change after migrate, so they are kept here once and inserted back as they were."""
    from django.apps import apps
    from django.contrib.auth.management import create_permissions
    from django.contrib.auth.models import Permission
    from django.contrib.contenttypes.management import create_contenttypes
    from django.contrib.contenttypes.models import ContentType
    from django.db.models.signals import post_migrate

    with django_db_blocker.unblock():
        content_types = list(ContentType.objects.all())
        permissions = list(Permission.objects.all())

    def refill(using: str, **kwargs: Any) -> None:
        ContentType.objects.using(using).bulk_create(content_types, ignore_conflicts=True)
        Permission.objects.using(using).bulk_create(permissions, ignore_conflicts=True)

    auth_uid = "django.contrib.auth.management.create_permissions"
    post_migrate.disconnect(create_permissions, dispatch_uid=auth_uid)
    post_migrate.disconnect(create_contenttypes)
    # Sent once per installed app: answered for one of them.
    once = apps.get_app_config("contenttypes")
    post_migrate.connect(refill, sender=once, weak=False)
    yield
    post_migrate.disconnect(refill, sender=once)
    post_migrate.connect(create_contenttypes)
    post_migrate.connect(create_permissions, dispatch_uid=auth_uid)


@pytest.fixture(autouse=True)
def _clean_redis(request: pytest.FixtureRequest) -> Iterator[None]:
    """An empty Redis for each test that may reach it, and nothing this process remembers of
    an earlier one's. A quick test reaches none (the guard above fails one that connects).

    The web side keeps a model's progress blocker for a few seconds (jobs.queries.queue_health):
    left over from the test before (whose workers were alive), it would expire in the middle
    of this one, and a batch page would see its version change with nothing changed."""
    if request.node.get_closest_marker("quick") is None:
        from jobs.lib import queues
        from jobs.queries import queue_health

        queues.connection().flushdb()
        queue_health._blockers.clear()
    yield


@pytest.fixture(autouse=True)
def _clean_storage() -> Iterator[None]:
    """Each test's stored files go with its database rows (after its worker processes have
    stopped: this fixture is set up first, so torn down last). Left behind, they would be
    orphans that every later test's cleanup pass lists and looks up again."""
    from django.conf import settings

    yield
    shutil.rmtree(settings.STORAGE_DIR, ignore_errors=True)


@pytest.fixture
def user(django_user_model: Any) -> Any:
    return django_user_model.objects.create_user("alice", password="pw-alice-123")


@pytest.fixture
def site(client: Any, user: Any) -> Any:
    """The Django test client signed in as `user` (the dashboard's tests)."""
    client.force_login(user)
    return client


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


def _openai(live_server: Any, key: str) -> Any:
    import openai

    return openai.OpenAI(base_url=live_server.url + "/v1", api_key=key, max_retries=0,
                         http_client=openai.DefaultHttpxClient(verify=TLS_CONTEXT))


def _anthropic(live_server: Any, key: str) -> Any:
    """The official anthropic client (its paths carry /v1)."""
    import anthropic

    return anthropic.Anthropic(base_url=live_server.url, api_key=key, max_retries=0,
                               http_client=anthropic.DefaultHttpxClient(verify=TLS_CONTEXT))


@pytest.fixture
def openai_client(live_server: Any, api_key: str) -> Any:
    return _openai(live_server, api_key)


@pytest.fixture
def other_client(live_server: Any, other_key: str) -> Any:
    return _openai(live_server, other_key)


@pytest.fixture
def anthropic_client(live_server: Any, api_key: str) -> Any:
    return _anthropic(live_server, api_key)


@pytest.fixture
def other_anthropic_client(live_server: Any, other_key: str) -> Any:
    return _anthropic(live_server, other_key)


@pytest.fixture
def workers(transactional_db: Any, tmp_path: Path) -> Iterator[Workers]:
    pool = Workers(tmp_path)
    yield pool
    pool.stop_all()
    # Shown by pytest only when the test failed.
    print("--- worker logs ---\n" + pool.logs())


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    server = Receiver()
    yield server
    server.close()


@pytest.fixture
def loopback_allowed(settings):
    settings.BATCHWEB = {**settings.BATCHWEB, "WEBHOOK_ALLOWED_NETWORKS": ["127.0.0.1/32"],
                         "WEBHOOK_ALLOWED_HOSTS": [], "WEBHOOK_RETRY_BASE_SECONDS": 10,
                         "WEBHOOK_MAX_ATTEMPTS": 4, "WEBHOOK_TIMEOUT_SECONDS": 2}
    return settings


@pytest.fixture(scope="session")
def smol_server(tmp_path_factory: Any) -> Iterator[Any]:
    """`vllm serve` of the default chat model on loopback (float32: greedy output does not
    depend on batching), priority scheduling and cached-token usage on, as docs/
    remote-engine.md says to start it; one per test session. Tests using it are marked
    `engine` (run under /tmp/engine.lock)."""
    from tests.vllmserve import VllmServe

    server = VllmServe("SmolLM2-135M-Instruct", "smol", "--dtype", "float32",
                       "--max-model-len", "512", "--max-num-seqs", "8",
                       "--scheduling-policy", "priority", "--enable-prompt-tokens-details",
                       log=tmp_path_factory.mktemp("vllm") / "serve.log")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()
