"""Factories for the tests: request lines and JSONL bodies; batches, shards and files brought
to any state by the service calls the workers make; the API through Django's test client
and the openai client; snapshots of the database and the storage ("nothing stored
changes"); worker processes, a private redis-server, free ports, waiting. Fixtures built on
them are in conftest.py."""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import io
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from django.apps import apps
from django.core.files.base import ContentFile
from django.core.files.storage import default_storage
from django.core.signals import request_finished, request_started
from django.db import close_old_connections, connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from jobs.formats.wire import response_line
from jobs.models import Batch, File, Quota, Shard, UsageRecord
from jobs.services.batches import create_batch
from jobs.services.files import create_input_file
from jobs.services.finalize import finalize_batch
from jobs.services.progress import refresh_progress
from jobs.services.shard_input import shard_custom_ids
from jobs.services.validation import run_validation
from jobs.storage.objects import new_storage_name, open_file
from jobs.worker.pipeline import Pipeline

ROOT = Path(__file__).resolve().parent.parent

# The header htmx sends, for the dashboard's partials.
HTMX = {"HTTP_HX_REQUEST": "true"}

# The TLS settings of every HTTP client the tests build (openai, anthropic, httpx). Each
# client would otherwise load the CA bundle again, ~25 ms of CPU, and the tests build
# hundreds; they speak plain HTTP on loopback, so one context serves them all.
TLS_CONTEXT = ssl.create_default_context()


class _Lazy:
    """A module's public names, the module imported on the first use of one."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_"):  # pytest's and others' probes of every module global
            raise AttributeError(attr)
        return getattr(importlib.import_module(self._name), attr)


def lazy_import(name: str) -> Any:
    """Module `name`, imported when a test first uses one of its names. The official SDKs
    take seconds of CPU to import (anthropic ~2 s, openai ~0.8 s): imported at collection,
    every test process would pay for them before its first test, whether it runs their
    tests or not."""
    return _Lazy(name)


# --- request lines ---


def chat_line(custom_id: str, text: str, *, model: str = "echo-test", **body: Any) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": text}], **body}}


def responses_line(custom_id: str, words: str, *, model: str = "echo-test",
                   **body: Any) -> dict:
    """A /v1/responses request whose input is `words` (or the `input` given in `body`)."""
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/responses",
            "body": {"model": model, "input": words, **body}}


def jsonl(lines: list[dict] | list[str]) -> bytes:
    return b"".join((json.dumps(x) if isinstance(x, dict) else x).encode() + b"\n"
                    for x in lines)


def chat_lines(n: int, prefix: str = "r") -> list[dict]:
    """`n` short chat requests, custom ids `{prefix}0`, `{prefix}1`, ..."""
    return [chat_line(f"{prefix}{i}", f"question {i}", max_tokens=10) for i in range(n)]


def shared_prefix_lines(n: int, *, groups: int = 5, prefix: str = "g",
                        **body: Any) -> list[dict]:
    """`n` chat requests in `groups` task templates (a long system prompt each, then the
    item), shuffled so no two neighbours share a template: the shape prefix planning
    groups. custom_ids `{prefix}{i}`; `template_of` tells an id's template."""
    lines = []
    for i in range(n):
        template = template_of(i, groups)
        system = (f"Template {template}: read the item and answer with one word. " * 8)
        lines.append({"custom_id": f"{prefix}{i}", "method": "POST",
                      "url": "/v1/chat/completions",
                      "body": {"model": "echo-test", "max_tokens": 4, **body, "messages": [
                          {"role": "system", "content": system},
                          {"role": "user", "content": f"item {i}"}]}})
    return lines


def template_of(i: int, groups: int = 5) -> int:
    return (i * 7 + i // groups) % groups


def requests_of_shape(shape: str, n: int, prefix: str) -> list[dict]:
    """Short requests that run in file order, or requests of a few long shared prompts,
    shuffled, that prefix planning groups (their shards then read their lines through the
    batch's line index, in group order). custom_ids `{prefix}{i}`."""
    if shape == "grouped":
        return shared_prefix_lines(n, prefix=prefix)
    return [chat_line(f"{prefix}{i}", f"question {i}", max_tokens=4) for i in range(n)]


# The guarantees that must hold whichever way a batch's shards were planned.
SHAPES = pytest.mark.parametrize("shape", ["file order", "grouped"])


# --- batches, shards and files without worker processes ---


def make_file(owner: Any, lines: list[dict] | list[str], tmp_path: Path,
              name: str = "in.jsonl") -> File:
    path = tmp_path / f"upload-{len(list(tmp_path.iterdir()))}.jsonl"
    path.write_bytes(jsonl(lines))
    return create_input_file(owner=owner, path=path, filename=name, purpose="batch")


def make_batch(owner: Any, lines: list[dict], tmp_path: Path, *, shard_size: int = 1000,
               settings: Any = None, endpoint: str = "/v1/chat/completions",
               **extra: Any) -> Batch:
    """A validated, running batch (shards planned, none run)."""
    if settings is not None:
        settings.BATCHWEB = {**settings.BATCHWEB, "SHARD_SIZE": shard_size}
    file = make_file(owner, lines, tmp_path)
    batch = create_batch(owner=owner, input_file_id=file.pk, endpoint=endpoint,
                         completion_window="24h", **extra)
    run_validation(batch_id=batch.pk)
    return Batch.objects.get(pk=batch.pk)


def chat_body(custom_id: str, text: str) -> dict[str, Any]:
    return {"id": f"chatcmpl-{custom_id[:20]}", "object": "chat.completion",
            "model": "echo-test",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}


def run_shard(shard: Shard, *, fails: Callable[[str], bool] = lambda c: False,
              answer: Callable[[str], str] = lambda c: f"echo: {c}",
              started: datetime | None = None, seconds: float = 10,
              status: Callable[[str], int] = lambda c: 400) -> None:
    """Do what a worker does for one shard: write its parts and record it done. A request
    `fails` with the engine's answer of HTTP `status`: a 400 (its prompt over the context)
    unless told otherwise."""
    out = io.BytesIO()
    err = io.BytesIO()
    completed = failed = 0
    for custom_id in shard_custom_ids(shard):
        if fails(custom_id):
            code = status(custom_id)
            message = ("This model's maximum context length is 2048 tokens." if code == 400
                       else f"The engine failed the request (HTTP {code}).")
            err.write(response_line(custom_id, code, {"error": {
                "message": message, "type": "BadRequestError" if code == 400 else
                "InternalServerError", "param": None, "code": code}}))
            failed += 1
        else:
            out.write(response_line(custom_id, 200, chat_body(custom_id, answer(custom_id))))
            completed += 1
    names = {}
    for kind, buffer in (("out", out), ("err", err)):
        data = buffer.getvalue()
        names[kind] = default_storage.save(new_storage_name(f"parts/{shard.batch_id}"),
                                           ContentFile(data)) if data else ""
    started = started or timezone.now() - timedelta(seconds=seconds)
    Shard.objects.filter(pk=shard.pk).update(
        status=Shard.Status.DONE, attempt=shard.attempt + 1, started_at=started,
        finished_at=started + timedelta(seconds=seconds), completed=completed, failed=failed,
        ran_ok=completed, ran_failed=failed, input_tokens=5 * completed,
        output_tokens=3 * completed, output_part=names["out"], error_part=names["err"],
        worker="test")
    refresh_progress(batch_id=shard.batch_id)


def run_batch(batch: Batch, *, only: int | None = None, **kwargs: Any) -> Batch:
    """Run every shard (or the first `only`), then finalize when all ran."""
    shards = list(Shard.objects.filter(batch=batch).exclude(status=Shard.Status.DONE)
                  .order_by("index"))
    for shard in shards[:only]:
        run_shard(shard, **kwargs)
    if only is None or only >= len(shards):
        finalize_batch(batch_id=batch.pk)
    return Batch.objects.get(pk=batch.pk)


def partly_run_batch(owner: Any, tmp_path: Path, settings: Any, *, requests: int,
                     shard_size: int, done: int, prefix: str = "r") -> Batch:
    """A running batch with `done` of its shards finished."""
    batch = make_batch(owner, chat_lines(requests, prefix), tmp_path, shard_size=shard_size,
                       settings=settings)
    for shard in Shard.objects.filter(batch=batch).order_by("index")[:done]:
        run_shard(shard)
    return batch


def claimed_batch(owner: Any, tmp_path: Path, settings: Any) -> tuple[Batch, Shard]:
    """A running batch of 10 requests in two shards, its first shard claimed by a worker
    (whose heartbeat and finish_shard the test then calls)."""
    from jobs.services.shards import claim_shard

    batch = make_batch(owner, chat_lines(10), tmp_path, shard_size=5, settings=settings)
    shard = claim_shard(shard_id=Shard.objects.get(batch=batch, index=0).pk, worker="w1")
    assert shard is not None
    return batch, shard


def lines_of(owner: Any, file_id: str) -> list[dict]:
    file = File.objects.get(pk=file_id, owner=owner)
    with default_storage.open(file.storage_name, "rb") as handle:
        return [json.loads(line) for line in handle.read().splitlines() if line.strip()]


# --- the API ---


class Api:
    """The /v1 API through Django's test client (in-process: fast, and an unhandled
    exception would surface as a 500 the tests count)."""

    def __init__(self, key: str) -> None:
        self.client = Client()
        self.headers = {"HTTP_AUTHORIZATION": f"Bearer {key}"}

    def get(self, path: str, **extra: Any) -> Any:
        return self.client.get(path, **{**self.headers, **extra})

    def delete(self, path: str) -> Any:
        return self.client.delete(path, **self.headers)

    def post_json(self, path: str, body: Any, **extra: Any) -> Any:
        data = body if isinstance(body, str | bytes) else json.dumps(body)
        return self.client.post(path, data=data, content_type="application/json",
                                **{**self.headers, **extra})

    def post_raw(self, path: str, data: bytes | str, content_type: str) -> Any:
        return self.client.post(path, data=data, content_type=content_type, **self.headers)

    def post_multipart(self, path: str, data: dict[str, Any]) -> Any:
        return self.client.post(path, data=data, **self.headers)

    def upload(self, content: bytes, *, filename: str = "in.jsonl", purpose: Any = "batch",
               **fields: Any) -> Any:
        # A plain stream rather than SimpleUploadedFile, which refuses names such as "/"
        # on the client side: any name must reach the server (the test client sends the
        # name's last path component, as browsers do).
        file = io.BytesIO(content)
        file.name = filename  # type: ignore[attr-defined]
        file.content_type = "application/jsonl"  # type: ignore[attr-defined]
        data: dict[str, Any] = {"file": file}
        if purpose is not None:
            data["purpose"] = purpose
        data.update(fields)
        return self.post_multipart("/v1/files", data)


def assert_openai_error(response: Any, status: int, *, code: str | None = None,
                        param: str | None = None, fragment: str | None = None) -> dict:
    """The response is the documented OpenAI error object with this status (and code,
    param, message fragment when given)."""
    assert response.status_code == status, (response.status_code, response.content[:500])
    assert response["Content-Type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    if fragment is not None:
        assert fragment in error["message"], error
    return error


def upload(client: Any, content: bytes) -> Any:
    """An input file uploaded through the openai client."""
    return client.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch")


def new_batch(client: Any, file_id: str, **extra: Any) -> Any:
    """A chat batch of 24 hours created through the openai client."""
    return client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                 completion_window="24h", **extra)


def submit(client: Any, lines: list[dict], **extra: Any) -> Any:
    """Upload `lines` and create their batch, through the openai client."""
    return new_batch(client, upload(client, jsonl(lines)).id, **extra)


def wait_status(client: Any, batch_id: str, statuses: set[str], timeout: float = 60) -> Any:
    """The batch (through the openai client) once its status is one of `statuses`; on a
    timeout, the database's view of the batch and its shards, to see where it stopped."""
    try:
        return wait_for(
            lambda: (b := client.batches.retrieve(batch_id)).status in statuses and b,
            timeout=timeout, message=f"{batch_id} to reach {statuses}")
    except AssertionError:
        batch = Batch.objects.get(pk=batch_id)
        shards = list(Shard.objects.filter(batch_id=batch_id).values_list(
            "index", "status", "attempt", "completed", "failed", "last_error"))
        raise AssertionError(f"{batch.status} stop={batch.stop_code} "
                             f"claimed={batch.finalize_claimed_at} shards={shards}") from None


def query_count(get: Callable[[], Any]) -> int:
    """The database queries of one request, after a first one has warmed it."""
    get()  # warm: the first use of an API key records last_used_at (once a minute)
    with CaptureQueriesContext(connection) as queries:
        response = get()
    assert response.status_code in (200, 286), response.status_code
    return len(queries)


def poll_of(html: str | bytes) -> tuple[str, float]:
    """The polling URL and interval (seconds) of the first polled block of a page or
    partial (hx-get and `hx-trigger="every Ns"`)."""
    text = html.decode() if isinstance(html, bytes) else html
    found = re.search(r'hx-get="([^"]*)" hx-trigger="every ([0-9.]+)s"', text)
    assert found, text[:2000]
    return found[1].replace("&amp;", "&"), float(found[2])


# --- storage, snapshots and what a batch wrote ---


# Fields that legitimately change on a refused request (a key's "last used" stamp).
VOLATILE_FIELDS = {"last_used_at"}


def wsgi_call(app: Any, method: str, path: str, headers: dict[str, str] | None = None,
              body: bytes = b"", environ: dict[str, Any] | None = None
              ) -> tuple[str, dict[str, str], bytes]:
    """Call a WSGI application as a server would: (status line, headers, body). `environ`:
    more of what a server may put in the request's environ."""
    request = {"REQUEST_METHOD": method, "PATH_INFO": path.partition("?")[0],
               "QUERY_STRING": path.partition("?")[2], "SERVER_NAME": "testserver",
               "SERVER_PORT": "80", "HTTP_HOST": "testserver", "wsgi.url_scheme": "http",
               "wsgi.input": io.BytesIO(body), "wsgi.errors": sys.stderr,
               "SERVER_PROTOCOL": "HTTP/1.1", "REMOTE_ADDR": "127.0.0.1",
               "CONTENT_LENGTH": str(len(body)), "CONTENT_TYPE": "application/json",
               "wsgi.multithread": True, "wsgi.multiprocess": True, "wsgi.run_once": False,
               "wsgi.version": (1, 0), **{f"HTTP_{k.upper().replace('-', '_')}": v
                                          for k, v in (headers or {}).items()},
               **(environ or {})}
    answer: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None
                       ) -> Any:
        answer.update(status=status, headers=dict(headers))

    with connection_kept():
        result = app(request, start_response)
        content = b"".join(result)
        if hasattr(result, "close"):  # optional in WSGI: a remembered poll has none
            result.close()
    return answer["status"], answer["headers"], content


@contextlib.contextmanager
def connection_kept() -> Iterator[None]:
    """As Django's test client does while it handles a request: the test's database
    connection (and its transaction) must outlive the request."""
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    try:
        yield
    finally:
        request_started.connect(close_old_connections)
        request_finished.connect(close_old_connections)


def use_private_storage(settings: Any, root: Path) -> Path:
    """Point Django's default storage (and the scratch directory) at `root`, so a test can
    see every object it creates and nothing another test (or person) creates."""
    storage = root / "storage"
    tmp = root / "tmp"
    storage.mkdir(parents=True, exist_ok=True)
    tmp.mkdir(parents=True, exist_ok=True)
    settings.STORAGES = {**settings.STORAGES, "default": {
        "BACKEND": "django.core.files.storage.FileSystemStorage",
        "OPTIONS": {"location": str(storage)}}}
    settings.TMP_DIR = tmp
    settings.FILE_UPLOAD_TEMP_DIR = str(tmp)
    assert Path(default_storage.location) == storage  # type: ignore[attr-defined]
    return storage


def storage_snapshot(root: Path) -> dict[str, str]:
    """Every object under a storage root with its content digest."""
    found = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = Path(dirpath) / name
            found[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def db_snapshot() -> dict[str, list[str]]:
    """Every row of the service's tables (and the users), as comparable text."""
    snapshot: dict[str, list[str]] = {}
    models = [*apps.get_app_config("jobs").get_models(), apps.get_model("auth", "User")]
    for model in models:
        rows = []
        for row in model.objects.values():
            rows.append(json.dumps({k: v for k, v in row.items() if k not in VOLATILE_FIELDS},
                                   sort_keys=True, default=str))
        snapshot[model.__name__] = sorted(rows)
    return snapshot


def assert_exactly_once(output_lines: list[dict], error_lines: list[dict],
                        expected: set[str]) -> None:
    """Every expected custom_id appears exactly once across a batch's output and error
    files, and nothing else does."""
    ids = [r["custom_id"] for r in output_lines + error_lines]
    assert len(ids) == len(set(ids)), "a custom_id appears twice"
    assert set(ids) == expected


def read_lines(file_id: str | None) -> list[dict]:
    """The lines of a stored file, which must hold exactly the bytes its row records."""
    if file_id is None:
        return []
    file = File.objects.get(pk=file_id)
    with default_storage.open(file.storage_name, "rb") as handle:
        data = handle.read()
    assert len(data) == file.bytes
    return [json.loads(line) for line in data.splitlines()]


def assert_every_custom_id_once(batch: Any, expected: set[str]) -> tuple[list, list]:
    """As assert_exactly_once, on the batch's stored files, counting what is doubled or
    lost (a fault test's batch has thousands of lines)."""
    out, err = read_lines(batch.output_file_id), read_lines(batch.error_file_id)
    ids = [r["custom_id"] for r in out + err]
    assert len(ids) == len(set(ids)), f"{len(ids) - len(set(ids))} custom_ids doubled"
    assert set(ids) == expected, f"{len(expected - set(ids))} custom_ids lost"
    return out, err


def assert_charged_once(batch_id: str, out: list[dict], *, copies: set[str] = frozenset()
                        ) -> None:
    """The usage ledger holds the batch's output exactly once: one record per finished
    shard, none for a shard that never finished, and its requests and tokens are the sums
    of the output lines' usage (`copies`: dedup copies' custom_ids, whose tokens are the
    computed request's and are not charged again)."""
    records = list(UsageRecord.objects.filter(batch_id=batch_id))
    done = set(Shard.objects.filter(batch_id=batch_id, status=Shard.Status.DONE)
               .values_list("pk", flat=True))
    assert sorted(r.shard_id for r in records) == sorted(done), "a shard charged twice or never"
    usage = [r["response"]["body"]["usage"] for r in out if r["custom_id"] not in copies]
    assert sum(r.requests_succeeded for r in records) == len(out)
    assert sum(r.input_tokens for r in records) == sum(u["prompt_tokens"] for u in usage)
    assert sum(r.output_tokens for r in records) == sum(u["completion_tokens"] for u in usage)


# --- the worker's pipeline in this process ---


def in_thread(run: Callable[[], object], *, name: str = "") -> threading.Thread:
    """`run` started in a thread of its own, which closes its database connection when it
    ends (Django never does: the test database could not be dropped)."""
    def target() -> None:
        try:
            run()
        finally:
            connection.close()

    thread = threading.Thread(target=target, name=name or None, daemon=True)
    thread.start()
    return thread


def start_shard(pipeline: Pipeline, shard_id: str) -> threading.Thread:
    """Run the RQ job's side in a thread of its own, as `batchworker` runs it in its main
    thread: it returns only once the engine's batch has room, which a slow engine delays."""
    return in_thread(lambda: pipeline.intake.run_shard(shard_id), name=f"job-{shard_id}")


def run_all_shards(pipeline: Pipeline, batch: Batch, *, timeout: float = 30) -> None:
    for shard_id in Shard.objects.filter(batch=batch).order_by("index").values_list(
            "pk", flat=True):
        pipeline.intake.run_shard(shard_id)
    wait_for(lambda: not Shard.objects.filter(batch=batch).exclude(status="done").exists(),
             timeout=timeout, message="every shard done")


def finalized(batch: Batch) -> tuple[Batch, list[dict], list[dict]]:
    """Finalize the batch; (batch, output lines, error lines), every custom_id at most once."""
    done = finalize_batch(batch_id=batch.pk)
    assert done is not None
    found = []
    for file in (done.output_file, done.error_file):
        lines = []
        if file is not None:
            with open_file(file) as stream:
                lines = [json.loads(line) for line in stream]
        found.append(lines)
    ids = [r["custom_id"] for r in found[0] + found[1]]
    assert len(ids) == len(set(ids)), "a custom_id appears twice"
    return done, found[0], found[1]


# --- processes and waiting ---


def database_url() -> str:
    """The test database as a URL, for worker processes."""
    from django.db import connection

    s = connection.settings_dict
    if s["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{s['NAME']}"
    auth = s["USER"] + (f":{s['PASSWORD']}" if s["PASSWORD"] else "")
    return f"postgres://{auth}@{s['HOST'] or '127.0.0.1'}:{s['PORT'] or 5432}/{s['NAME']}"


class Workers:
    """Real `manage.py batchworker` processes on the test database."""

    def __init__(self, log_dir: Path) -> None:
        self.procs: list[subprocess.Popen] = []
        self.log_dir = log_dir

    def start(self, model: str = "echo-test", *, env: dict[str, str] | None = None,
              args: list[str] | None = None) -> subprocess.Popen:
        return self._spawn(["batchworker", "--model", model, *(args or [])], env)

    def start_control(self, *, env: dict[str, str] | None = None) -> subprocess.Popen:
        """`manage.py controlworker`: validation, finalization and the reconciler, no
        engine."""
        return self._spawn(["controlworker"], env)

    def _spawn(self, command: list[str], env: dict[str, str] | None) -> subprocess.Popen:
        # Eager unless the test (or the environment) asks for another mode: under the
        # default `auto` a model's second start compiles (minutes on 2 cores), and tests
        # start workers many times.
        full_env = {"BATCHWEB_ENGINE_MODE": "eager", **os.environ,
                    "DATABASE_URL": database_url(), **(env or {})}
        with open(self.log_dir / f"worker-{len(self.procs)}.log", "wb") as log:
            proc = subprocess.Popen([sys.executable, str(ROOT / "manage.py"), *command],
                                    env=full_env, stdout=log, stderr=subprocess.STDOUT,
                                    cwd=ROOT)
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                # Stuck: its threads' stacks go to its log (batchworker's SIGUSR1), so
                # the failing test shows where it waits, before it is killed.
                proc.send_signal(signal.SIGUSR1)
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-4000:]
                         for p in sorted(self.log_dir.glob("worker-*.log")))


def wait_for(predicate: Callable[[], Any], *, timeout: float = 60, every: float = 0.2,
             message: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {message}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PrivateRedis:
    """A redis-server of the test's own, without persistence, that can be stopped (its
    data is then gone, as after a crash) and started again on the same port.

    Not jobs.storage.embedded.PrivateRedis: that one stops with SIGTERM on a unix socket; the
    fault tests kill this one (SIGKILL, a crash) and give workers a TCP REDIS_URL."""

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


def engine_request_log(path: Path) -> dict[tuple[str, int], int]:
    """How often the echo engine computed each (shard, input line), from the request log
    it writes when BATCHWEB_ECHO_REQUEST_LOG (its `request_log` option) names a file.
    A JSON retry counts as a second computation of its line."""
    counts: dict[tuple[str, int], int] = {}
    if not path.exists():
        return counts
    for request_id in path.read_text().split():
        shard_id, _attempt, line = request_id.rsplit(":", 2)
        key = (shard_id, int(line.rstrip("r")))
        counts[key] = counts.get(key, 0) + 1
    return counts


def computed_twice(path: Path) -> int:
    """Computations beyond the first of each line in an echo engine's request log."""
    return sum(n - 1 for n in engine_request_log(path).values())


def prometheus_values(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of a Prometheus text page."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def set_quota(user, **limits) -> Quota:
    quota, _ = Quota.objects.update_or_create(user=user, defaults=limits)
    return quota


def used_tokens(user, tmp_path, tokens: int, *, finished_at) -> Batch:
    """An ended batch of `user` whose one shard used `tokens` tokens, finished then."""
    batch = make_batch(user, [chat_line("t", "x")], tmp_path)
    Shard.objects.filter(batch=batch).update(
        status=Shard.Status.DONE, completed=1, input_tokens=tokens - tokens // 2,
        output_tokens=tokens // 2, finished_at=finished_at)
    Batch.objects.filter(pk=batch.pk).update(status=Batch.Status.COMPLETED,
                                             completed_at=finished_at)
    return batch


class Receiver:
    """An HTTP server on loopback that records every request and answers with the next
    scripted status (then 200), optionally after a delay."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.script: list[int] = []
        self.delay = 0.0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                receiver.requests.append({"path": self.path, "headers": dict(self.headers),
                                          "body": body})
                time.sleep(receiver.delay)
                status = receiver.script.pop(0) if receiver.script else 200
                self.send_response(status)
                if status in (301, 302):
                    self.send_header("Location", "http://127.0.0.1:1/elsewhere")
                self.end_headers()
                self.wfile.write(b"ok" if status == 200 else b"nope")

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_port}/hooks/batch?src=bw"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def response_text(response) -> str:
    """A response's body as text, streamed (downloads) or not."""
    return b"".join(response.streaming_content).decode() if response.streaming else \
        response.content.decode()


def register_worker(name: str, host: str, *, heartbeat_age: float = 0.0,
                    model: str = "echo-test") -> Any:
    """An RQ worker registered in Redis as batchworker registers one (its model's queues,
    its host), its last heartbeat `heartbeat_age` seconds ago."""
    from rq.utils import utcformat

    from jobs.lib import queues
    from jobs.worker.rq_worker import BatchWorker

    worker = BatchWorker([queues.queue(q) for q in queues.model_queue_names(model)],
                         name=name, connection=queues.connection())
    worker.hostname = host
    worker.register_birth()
    worker.set_state("idle")  # as it is while it waits for a job
    beat = timezone.now() - timedelta(seconds=heartbeat_age)
    queues.connection().hset(worker.key, "last_heartbeat", utcformat(beat))
    return worker


def heartbeat(*, shard_id: str, attempt: int, progress: Any, unsaved: int | None = 0,
              moved: bool = True) -> tuple[bool, str]:
    """One attempt's heartbeat, as a worker beating for that shard alone sends it: (still
    ours, its batch's stop code)."""
    from jobs.models import Shard
    from jobs.services.shards import Beat, heartbeats

    batch_id = Shard.objects.values_list("batch_id", flat=True).get(pk=shard_id)
    mine, stop_codes = heartbeats(beats=[Beat(shard_id, attempt, batch_id, progress,
                                              unsaved, moved)])
    return shard_id in mine, stop_codes.get(batch_id, "")
