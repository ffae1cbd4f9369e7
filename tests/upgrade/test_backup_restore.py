"""A backup taken while a batch runs, restored into a fresh deployment (new database, new
Redis, new storage, new processes), on both storage setups: the embedded default (SQLite and
a local folder: sqlite3's online backup, then the folder) and PostgreSQL with S3 (pg_dump,
then the bucket). The database first, then the files: every row the backup holds names
objects written before its transaction committed, so the copy made after it has them
(docs/upgrading.md). After the restore the batch finishes: every result saved before the
backup is kept and not computed again, every custom_id is in the output once, and the usage
ledger charges each shard once."""

from __future__ import annotations

import contextlib
import io
import shutil
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from jobs.storage.embedded import PrivateS3
from tests.factories import ROOT, PrivateRedis, chat_line, jsonl, wait_for
from tests.upgrade.stack import (
    Stack,
    checkpointed,
    figures,
    ledger,
    report,
    results,
    scratch_database,
    wait_ended,
)

pytestmark = pytest.mark.upgrade

N = 600
# Slow enough that a backup lands mid-batch: 2 workers of ~20 requests/s, results saved
# every 10 requests or half a second.
ENV = {"BATCHWEB_SHARD_SIZE": "100", "BATCHWEB_ECHO_SECONDS": "0.1",
       "BATCHWEB_ECHO_MAX_IN_FLIGHT": "2", "BATCHWEB_CHECKPOINT_SECONDS": "0.5",
       "BATCHWEB_CHECKPOINT_REQUESTS": "10"}


class Setup:
    """Where a deployment keeps its data, and how it is backed up and restored."""

    def __init__(self, kind: str, root: Path, s3: PrivateS3 | None) -> None:
        self.kind, self.root, self.s3 = kind, root, s3

    @contextlib.contextmanager
    def database(self, label: str) -> Iterator[str]:
        if self.kind == "sqlite-files":
            yield f"sqlite:///{self.root / label / 'batchweb.sqlite3'}"
        else:
            with scratch_database(label) as url:
                yield url

    def storage(self, label: str) -> dict[str, str]:
        if self.s3 is None:
            folder = self.root / label / "storage"
            folder.mkdir(parents=True, exist_ok=True)
            return {"BATCHWEB_STORAGE_DIR": str(folder)}
        bucket = f"bw-{label}-{self.root.name[-8:]}".lower().replace("_", "-")
        self.s3.client().create_bucket(Bucket=bucket)
        return self.s3.storage_env(bucket, "deploy")

    def backup(self, stack: Stack, dest: Path) -> None:
        """The database, then the files."""
        dest.mkdir(parents=True)
        if self.s3 is None:
            source = sqlite3.connect(stack.database_url[len("sqlite:///"):])
            target = sqlite3.connect(dest / "batchweb.sqlite3")
            with contextlib.closing(source), contextlib.closing(target):
                source.backup(target)  # consistent while the workers write
            shutil.copytree(stack.storage_env["BATCHWEB_STORAGE_DIR"], dest / "storage")
            return
        subprocess.run(["pg_dump", "--format=custom", "--file", str(dest / "db.dump"),
                        stack.database_url], check=True)
        client, bucket = self.s3.client(), stack.storage_env["BATCHWEB_S3_BUCKET"]
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            for item in page.get("Contents", ()):
                path = dest / "objects" / item["Key"]
                path.parent.mkdir(parents=True, exist_ok=True)
                client.download_file(bucket, item["Key"], str(path))

    def restore(self, source: Path, database_url: str, storage: dict[str, str]) -> None:
        if self.s3 is None:
            path = Path(database_url[len("sqlite:///"):])
            path.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(source / "batchweb.sqlite3", path)
            shutil.rmtree(storage["BATCHWEB_STORAGE_DIR"])
            shutil.copytree(source / "storage", storage["BATCHWEB_STORAGE_DIR"])
            return
        subprocess.run(["pg_restore", "--no-owner", "--dbname", database_url,
                        str(source / "db.dump")], check=True)
        client, bucket = self.s3.client(), storage["BATCHWEB_S3_BUCKET"]
        for path in sorted((source / "objects").rglob("*")):
            if path.is_file():
                client.upload_file(str(path), bucket,
                                   str(path.relative_to(source / "objects")))

    def stored(self, stack: Stack) -> int:
        if self.s3 is None:
            return sum(1 for p in Path(stack.storage_env["BATCHWEB_STORAGE_DIR"]).rglob("*")
                       if p.is_file())
        pages = self.s3.client().get_paginator("list_objects_v2").paginate(
            Bucket=stack.storage_env["BATCHWEB_S3_BUCKET"])
        return sum(len(page.get("Contents", ())) for page in pages)


@pytest.fixture(params=["sqlite-files", "postgres-s3"])
def setup(request: Any, tmp_path: Path) -> Iterator[Setup]:
    if request.param == "sqlite-files":
        yield Setup(request.param, tmp_path, None)
        return
    from tests.upgrade.stack import server_url

    server_url()  # skips without PostgreSQL
    server = PrivateS3(tmp_path)
    try:
        yield Setup(request.param, tmp_path, server)
    finally:
        server.stop()


def start(stack: Stack, workers: int = 2) -> None:
    stack.web()
    stack.control()
    for _ in range(workers):
        stack.worker()


def test_a_backup_mid_batch_restored_finishes_it_once(setup: Setup, tmp_path: Path) -> None:
    redis_a, redis_b = PrivateRedis(tmp_path), PrivateRedis(tmp_path)
    redis_a.start()
    with setup.database("a") as db_a, setup.database("b") as db_b:
        a = Stack(ROOT, db_a, redis_a, setup.storage("a"), tmp_path / "a", ENV)
        b = None
        try:
            a.manage("migrate", "--noinput", "-v0")
            key = a.api_key()
            start(a)
            client = a.openai(key)
            expected = {f"r{i}" for i in range(N)}
            upload = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(
                [chat_line(f"r{i}", f"question {i}", max_tokens=8) for i in range(N)]))),
                purpose="batch")
            batch = client.batches.create(input_file_id=upload.id,
                                          endpoint="/v1/chat/completions",
                                          completion_window="24h")
            wait_for(lambda: len(checkpointed(a, batch.id)) >= N // 4, timeout=180,
                     message="a quarter of the results saved")
            setup.backup(a, tmp_path / "backup")
            a.stop_all()  # the original deployment is gone (the mistake)

            # A fresh deployment from the backup: its own database, Redis and storage.
            redis_b.start()
            b = Stack(ROOT, db_b, redis_b, setup.storage("b"), tmp_path / "b", ENV)
            setup.restore(tmp_path / "backup", db_b, b.storage_env)
            b.manage("migrate", "--noinput", "-v0")  # nothing to apply: the same release
            saved = checkpointed(b, batch.id)
            assert 0 < len(saved) < N, "the backup is not of a batch mid-way"
            start(b)
            client = b.openai(key)
            ended = wait_ended(client, batch.id, timeout=300, stack=b)
            lines = results(client, ended)
            found = figures(lines, expected)
            charged = ledger(b, batch.id)
            computed = b.computed()
            again = sum(1 for line in saved if line in computed)
            outputs = [line for line in lines if line.get("response")]
            usage = [line["response"]["body"]["usage"] for line in outputs]
            report(f"restore ({setup.kind}): {len(saved)}/{N} results saved at the backup; "
                  f"after the restore {sum(computed.values())} computed, "
                  f"{again} of the saved computed again; lost {found['lost']}, "
                  f"duplicated {found['duplicated']}, "
                  f"charged twice {charged['charged_twice']}, "
                  f"objects {setup.stored(b)}")
            assert ended.status == "completed", b.logs()
            assert found == {"lost": 0, "duplicated": 0, "unexpected": 0}
            assert ended.request_counts.total == N and ended.request_counts.completed == N
            assert charged["charged_twice"] == 0 and charged["never_charged"] == 0
            assert charged["requests"] == len(outputs) == N
            assert charged["input_tokens"] == sum(u["prompt_tokens"] for u in usage)
            assert charged["output_tokens"] == sum(u["completion_tokens"] for u in usage)
            assert again == 0, "results saved before the backup were computed again"
        except BaseException:
            print(a.logs())
            if b is not None:
                print(b.logs())
            raise
        finally:
            a.stop_all()
            if b is not None:
                b.stop_all()
            redis_a.stop()
            redis_b.stop()
