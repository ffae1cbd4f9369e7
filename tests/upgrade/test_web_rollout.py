"""The web server replaced under load, as a rolling update replaces a web pod: 50 clients of
the official openai client (its default retries) upload files and poll while the previous
release's web server runs; this release's migrations run beside it, this release's web
server starts on the same address (both behind one port, as two pods behind a Service),
and the previous one gets SIGTERM and its grace period. No client sees an error, and every
upload a client was answered for is stored whole."""

from __future__ import annotations

import hashlib
import io
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.factories import ROOT, PrivateRedis, chat_line, jsonl
from tests.upgrade.stack import Stack, report, scratch_database, server_url

pytestmark = pytest.mark.upgrade

CLIENTS = 50


class Client(threading.Thread):
    """One API client: uploads a small file, then polls it and the batch list, again."""

    def __init__(self, index: int, make: Any, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        import httpx

        self.index, self.stop = index, stop
        self.calls = self.attempts = 0
        self.errors: list[str] = []
        self.uploads: dict[str, str] = {}  # file id -> sha256 of what was sent

        def count(request: Any) -> None:
            self.attempts += 1

        self.client = make(http_client=httpx.Client(event_hooks={"request": [count]},
                                                    timeout=60))

    def run(self) -> None:
        round_ = 0
        while not self.stop.is_set():
            try:
                if round_ % 3 == 0:
                    body = jsonl([chat_line(f"c{self.index}-{round_}-{i}", f"q {i}")
                                  for i in range(20)])
                    self.calls += 1
                    made = self.client.files.create(file=("in.jsonl", io.BytesIO(body)),
                                                    purpose="batch")
                    self.uploads[made.id] = hashlib.sha256(body).hexdigest()
                else:
                    self.calls += 2
                    self.client.files.retrieve(next(iter(self.uploads)))
                    self.client.batches.list(limit=5)
            except Exception as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}")
            round_ += 1
            time.sleep(0.3)


def test_the_web_server_replaced_under_50_clients_fails_none(previous, tmp_path: Path
                                                               ) -> None:
    release, old_tree = previous
    server_url()  # skips without PostgreSQL
    redis = PrivateRedis(tmp_path)
    redis.start()
    storage = {"BATCHWEB_STORAGE_DIR": str(tmp_path / "storage")}
    with scratch_database("rollout") as database:
        old = Stack(old_tree, database, redis, storage, tmp_path / "old")
        new = Stack(ROOT, database, redis, storage, tmp_path / "new", port=old.port)
        stop = threading.Event()
        clients: list[Client] = []
        try:
            old.manage("migrate", "--noinput", "-v0")
            key = old.api_key()
            old_web = old.web()
            clients = [Client(i, lambda **kw: old.openai(key, **kw), stop)
                       for i in range(CLIENTS)]
            for client in clients:
                client.start()
            time.sleep(5)
            new.manage("migrate", "--noinput", "-v0")  # the rollout's first step
            new.web()  # up beside the old one
            replacing = time.monotonic()
            old.stop(old_web)  # SIGTERM, its grace period
            replaced = time.monotonic() - replacing
            time.sleep(5)  # the clients on the new server alone
            stop.set()
            for client in clients:
                client.join(timeout=120)

            checker = new.openai(key)
            uploads = {fid: digest for c in clients for fid, digest in c.uploads.items()}
            lost = sum(1 for fid, digest in uploads.items()
                       if hashlib.sha256(checker.files.content(fid).content).hexdigest()
                       != digest)
            failed = [c for c in clients if c.errors]
            calls = sum(c.calls for c in clients)
            retries = sum(c.attempts for c in clients) - calls
            report(f"rollout {release.version} -> this release: {CLIENTS} clients, {calls} "
                  f"calls ({retries} retried by the client), {len(uploads)} uploads; the old "
                  f"server stopped in {replaced:.1f} s, killed {old.killed}; clients failed "
                  f"{len(failed)}, uploads lost {lost}")
            assert not failed, [c.errors for c in failed][:3]
            assert lost == 0 and old.killed == 0
            assert len(uploads) >= CLIENTS
        except BaseException:
            print(old.logs() + new.logs())
            raise
        finally:
            stop.set()
            old.stop_all()
            new.stop_all()
            redis.stop()
