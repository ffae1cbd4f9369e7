"""Batches through `batchworker` processes whose model runs on a real `vllm serve`, behind
the tests' fault proxy: the pipeline's guarantees (dedup, refusals in the error file,
usage charged once, exactly-once output) hold with the remote engine, through 429s and
resets, and across a worker SIGKILLed with requests in flight on the server."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from django.conf import settings as django_settings

from engine.remote_limits import server_state
from jobs.models import Batch, Shard
from tests.engine import needs_vllm
from tests.factories import (
    assert_charged_once,
    assert_exactly_once,
    chat_line,
    read_lines,
    submit,
    wait_for,
    wait_status,
)
from tests.faultproxy import FaultProxy

pytestmark = [needs_vllm, pytest.mark.engine, pytest.mark.timeout(600)]

NAME = "smol-remote"


@pytest.fixture
def proxy(smol_server: Any) -> Iterator[FaultProxy]:
    made = FaultProxy(smol_server.url.removesuffix("/v1"))
    yield made
    made.close()


@pytest.fixture
def remote_env(settings: Any, tmp_path: Any, proxy: FaultProxy) -> dict[str, str]:
    """The remote model, declared to this process and (by file) to the workers."""
    models = [{"name": NAME, "backend": "remote",
               "endpoints": ["/v1/chat/completions", "/v1/completions"],
               "options": {"base_url": proxy.url, "model": "smol", "max_concurrency": 4,
                           "backoff_base": 0.2}}]
    settings.BATCHWEB_MODELS = models
    path = tmp_path / "models.json"
    path.write_text(json.dumps(models))
    return {"BATCHWEB_MODELS_FILE": str(path), "BATCHWEB_ECHO_MODEL": "0",
            "BATCHWEB_SHARD_SIZE": "10"}


def line(custom_id: str, text: str, **body: Any) -> dict:
    return chat_line(custom_id, text, model=NAME, **{"max_tokens": 4, "temperature": 0,
                                                     **body})


def outputs(batch: Any) -> tuple[list[dict], list[dict]]:
    return read_lines(batch.output_file_id), read_lines(batch.error_file_id)


def test_a_batch_runs_on_the_remote_server(openai_client, workers, remote_env, proxy):
    lines = [line(f"r{i}", f"Name a fruit, number {i}.") for i in range(20)]
    lines += [line("dup-a", "Name a fruit, number 3."), line("dup-b", "Name a fruit, number 4.")]
    lines.append(line("too-long", "Hello.", max_tokens=4000))  # > the 512-token context
    proxy.faults += [("status", 429, 1), ("reset",), ("status", 503, None)]
    batch = submit(openai_client, lines)
    workers.start(NAME, env=remote_env)
    batch = wait_status(openai_client, batch.id, {"completed"}, timeout=300)
    out, err = outputs(batch)
    assert_exactly_once(out, err, {entry["custom_id"] for entry in lines})
    assert [e["custom_id"] for e in err] == ["too-long"]
    assert "max_model_len=512" in err[0]["response"]["body"]["error"]["message"]
    assert {o["response"]["body"]["model"] for o in out} == {NAME}
    by_id = {o["custom_id"]: o["response"]["body"] for o in out}
    assert by_id["dup-a"]["choices"] == by_id["r3"]["choices"]
    stored = Batch.objects.get(pk=batch.id)
    assert stored.dedup_saved == 2
    assert_charged_once(batch.id, out, copies={"dup-a", "dup-b"})
    # Each line reached the server once, but for the injected faults' retries: the dedup
    # copies never did.
    assert len(proxy.posts) == 21 + 3


def test_a_sigkilled_worker_loses_and_doubles_nothing(openai_client, workers, remote_env,
                                                       proxy):
    lines = [line(f"k{i}", f"Name an animal, number {i}.") for i in range(40)]
    # Slow answers keep requests in flight on the server when the kill lands.
    proxy.faults += [("slow", 0.6)] * 60
    batch = submit(openai_client, lines)
    victim = workers.start(NAME, env=remote_env)
    wait_for(lambda: Shard.objects.filter(batch_id=batch.id, status="running",
                                          completed__gt=0).exists() and proxy.in_flight > 0,
             timeout=240, every=0.05, message="a running shard with requests in flight")
    client = redis.Redis.from_url(django_settings.REDIS_URL)
    assert server_state(client, proxy.url, ceiling=4).in_flight > 0
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    # Its leases are never given back: they expire, and the next worker gets the slots.
    workers.start(NAME, env=remote_env)
    batch = wait_status(openai_client, batch.id, {"completed"}, timeout=300)
    out, err = outputs(batch)
    assert_exactly_once(out, err, {f"k{i}" for i in range(40)})
    assert len(out) == 40 and not err
    assert_charged_once(batch.id, out)
    assert Shard.objects.filter(batch_id=batch.id, failures__gt=0).exists()
    assert server_state(client, proxy.url, ceiling=4).in_flight == 0
