"""The previous release upgraded in place to this one with a batch in flight, as a rolling
update does it, on PostgreSQL, Redis and a storage folder that outlive the processes.

The previous release's web server, control worker and two workers (its tree, from this
repository's history) run a batch until it is mid-shard with results checkpointed. This
release's migrations run first, with all of them running on: a second batch is created
through the old web server and validated by the old control worker on the migrated schema.
Then each old process gets SIGTERM and its grace period (the workers drain, handing back
what they hold), this release's processes start, and beside them one of the previous
release's workers stays, as during a rolling update; a third batch goes to that mixed
fleet. All three complete: every custom_id once, the counts and the usage ledger exact, no
saved result computed again, both releases' workers taking shards, and both APIs and the
batch's page answering every poll but those of the web server's restart."""

from __future__ import annotations

import io
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.factories import ROOT, PrivateRedis, chat_line, jsonl, wait_for
from tests.upgrade.stack import (
    Stack,
    checkpointed,
    figures,
    ledger,
    report,
    results,
    scratch_database,
    server_url,
    wait_ended,
)

pytestmark = pytest.mark.upgrade

N = 800
# Shards of ~10 s, results saved every 10 requests or half a second.
ENV = {"BATCHWEB_SHARD_SIZE": "200", "BATCHWEB_ECHO_SECONDS": "0.4",
       "BATCHWEB_ECHO_MAX_IN_FLIGHT": "8", "BATCHWEB_CHECKPOINT_SECONDS": "0.5",
       "BATCHWEB_CHECKPOINT_REQUESTS": "10"}


class Poller:
    """Every 0.2 s, with no retries: the batch through the OpenAI API, the Message Batches
    list through the Anthropic API, and the batch's page signed in; when each failed."""

    def __init__(self, stack: Stack, key: str, password: str, batch_id: str) -> None:
        import anthropic

        base = f"http://127.0.0.1:{stack.port}"
        self.checks = {
            "openai": lambda: stack.openai(key, max_retries=0).batches.retrieve(batch_id),
            "anthropic": lambda: anthropic.Anthropic(
                base_url=base, api_key=key, max_retries=0).messages.batches.list(limit=1),
            "page": self.page,
        }
        self.browser = stack.signed_in(password)
        self.batch_id = batch_id
        self.ok = 0
        self.failed: list[tuple[str, float]] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def page(self) -> None:
        answer = self.browser.get(f"/batches/{self.batch_id}/")
        assert answer.status_code == 200 and self.batch_id in answer.text, answer.status_code

    def run(self) -> None:
        while not self.done.is_set():
            for name, check in self.checks.items():
                try:
                    check()
                    self.ok += 1
                except Exception:
                    self.failed.append((name, time.monotonic()))
            time.sleep(0.2)

    def stop(self) -> None:
        self.done.set()
        self.thread.join()


def submit(client: Any, prefix: str) -> tuple[str, set[str]]:
    upload = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(
        [chat_line(f"{prefix}{i}", f"question {i}", max_tokens=8) for i in range(N)]))),
        purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    return batch.id, {f"{prefix}{i}" for i in range(N)}


def check(stack: Stack, client: Any, batch_id: str, expected: set[str], label: str
          ) -> dict[str, int]:
    ended = wait_ended(client, batch_id, timeout=300, stack=stack)
    lines = results(client, ended)
    found = figures(lines, expected)
    charged = ledger(stack, batch_id)
    usage = [line["response"]["body"]["usage"] for line in lines if line.get("response")]
    report(f"upgrade: {label}: {ended.status}, lost {found['lost']}, duplicated "
          f"{found['duplicated']}, charged twice {charged['charged_twice']}, never charged "
          f"{charged['never_charged']}")
    assert ended.status == "completed"
    assert found == {"lost": 0, "duplicated": 0, "unexpected": 0}
    assert (ended.request_counts.total, ended.request_counts.completed) == (N, N)
    assert charged["charged_twice"] == 0 and charged["never_charged"] == 0
    assert charged["requests"] == len(usage) == N
    assert charged["input_tokens"] == sum(u["prompt_tokens"] for u in usage)
    assert charged["output_tokens"] == sum(u["completion_tokens"] for u in usage)
    return found


def module_file(stack: Stack) -> str:
    """Where the stack's processes import batchweb from."""
    return stack.manage("shell", "-v0", "-c",
                        "import batchweb.settings as s; print(s.__file__)").strip()


def test_the_previous_release_upgraded_under_a_running_batch(previous, tmp_path: Path) -> None:
    release, old_tree = previous
    server_url()  # skips without PostgreSQL
    redis = PrivateRedis(tmp_path)
    redis.start()
    storage = {"BATCHWEB_STORAGE_DIR": str(tmp_path / "storage")}
    stacks: list[Stack] = []
    with scratch_database("upgrade") as database:
        try:
            def stack(tree: Path, label: str) -> Stack:
                made = Stack(tree, database, redis, storage, tmp_path / label, ENV)
                stacks.append(made)
                return made

            old = stack(old_tree, "old")
            assert module_file(old).startswith(str(old_tree))
            old.manage("migrate", "--noinput", "-v0")
            password, key = old.demo_user()
            web = old.web()
            old.control()
            old_workers = [old.worker(name=f"old-{i}") for i in range(2)]
            client = old.openai(key, max_retries=0)
            first, first_ids = submit(client, "a")
            poller = Poller(old, key, password, first)

            def mid_shard() -> bool:
                running = old.query("SELECT count(*) FROM jobs_shard WHERE batch_id = %s "
                                    "AND status = 'running' AND checkpoint::text LIKE "
                                    "'%%\"lines\": [[%%'", first)[0][0]
                return running > 0 and len(checkpointed(old, first)) >= N // 4

            wait_for(mid_shard, timeout=180, message="a shard mid-way with saved results")

            # The rolling update. First this release's migrations, with every process of
            # the previous release running on: they go on working on the migrated schema,
            # a batch created through the old web server and validated by the old
            # control worker included.
            new = stack(ROOT, "new")
            assert module_file(new).startswith(str(ROOT))
            new.manage("migrate", "--noinput", "-v0")
            second, second_ids = submit(client, "b")
            wait_for(lambda: client.batches.retrieve(second).status != "validating",
                     timeout=120, message="the old control worker's validation")
            assert client.batches.retrieve(second).status == "in_progress"
            # Then the previous release's processes stopped (SIGTERM, the grace period)
            # and this release's started, the web server at the same address (as behind
            # a Service).
            for proc in old_workers:
                old.stop(proc)
            saved = checkpointed(old, first) | checkpointed(old, second)
            stopped = time.monotonic()
            old.stop(web)
            for proc in old.procs:
                old.stop(proc)
            new.port = old.port
            new.web()
            restarted = time.monotonic()
            new.control()
            new.worker(name="new-0")
            # A worker of the previous release that the update has not reached yet, beside
            # the new ones: it keeps taking shards.
            straggler = stack(old_tree, "straggler")
            straggler.worker(name="old-straggler")
            client = new.openai(key, max_retries=0)
            third, third_ids = submit(client, "c")
            check(new, client, first, first_ids, f"batch across the upgrade {release.version}"
                  f" -> this release")
            poller.stop()
            check(new, client, second, second_ids, "batch created by the previous release "
                  "on the migrated schema")
            check(new, client, third, third_ids, "batch on the mixed fleet")

            computed = {**straggler.computed()}
            for line, count in new.computed().items():
                computed[line] = computed.get(line, 0) + count
            again = sum(1 for line in saved if line in computed)
            per_shard: dict[str, int] = {}
            for shard_id, _ in saved:
                per_shard[shard_id] = per_shard.get(shard_id, 0) + 1
            resumed = sum(1 for count in per_shard.values() if count < 200)
            workers = dict(new.query(
                "SELECT worker, count(*) FROM jobs_shard WHERE batch_id IN (%s, %s, %s) "
                "AND status = 'done' GROUP BY worker", first, second, third))
            outside = [(name, t) for name, t in poller.failed
                       if not stopped <= t <= restarted + 1]
            report(f"upgrade: {len(saved)}/{2 * N} results saved before the update "
                   f"({resumed} shards handed back mid-way, the rest finished in the "
                   f"drain), {again} computed again; polls (OpenAI, Anthropic, page) "
                   f"answered {poller.ok}, failed during the web restart "
                   f"{len(poller.failed) - len(outside)} ({restarted - stopped:.1f} s), "
                   f"failed outside it {len(outside)}; processes killed at the grace "
                   f"period {old.killed}; shards done by worker {workers}")
            assert again == 0
            assert outside == []
            assert old.killed == 0
            assert workers.get("old-straggler", 0) > 0 and workers.get("new-0", 0) > 0
        except BaseException:
            for made in stacks:
                print(made.logs())
            raise
        finally:
            for made in stacks:
                made.stop_all()
            redis.stop()
