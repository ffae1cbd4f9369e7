"""The remote engine against a real `vllm serve` of SmolLM2-135M-Instruct (CPU, float32,
priority scheduling) with the tests' fault proxy in front: every endpoint of a chat model,
cached tokens and the owner's salt through the server, faults that change no answer, a
bad request answered with the server's own error, an abort that frees the server."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis

from engine.base import EngineRequest, ModelSpec
from engine.endpoints import CHAT, COMPLETIONS, MESSAGES, RESPONSES, usage_of
from engine.remote import RemoteEngine, vllm_queue
from engine.remote_limits import server_state
from tests.engine import needs_vllm
from tests.faultproxy import FaultProxy

pytestmark = [needs_vllm, pytest.mark.engine, pytest.mark.timeout(600)]

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
NAME = "smol-remote"
# ~150 tokens of system prompt: several KV blocks to find in the prefix cache.
SYSTEM = " ".join(f"Rule {i}: answer briefly and politely." for i in range(25))


@pytest.fixture
def proxy(smol_server: Any) -> Iterator[FaultProxy]:
    made = FaultProxy(smol_server.url.removesuffix("/v1"))
    yield made
    made.close()


@pytest.fixture
def make_engine(proxy: FaultProxy) -> Iterator[Any]:
    made: list[RemoteEngine] = []

    def make(**options: Any) -> RemoteEngine:
        engine = RemoteEngine(ModelSpec(name=NAME, backend="remote", options={
            "base_url": proxy.url, "model": "smol", "redis_url": REDIS_URL,
            "max_concurrency": 4, "backoff_base": 0.1, **options}))
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


def chat(rid: str, text: str, *, salt: str = "", system: str = "", **body: Any
         ) -> EngineRequest:
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": text}]
    return EngineRequest(rid, CHAT, {"model": NAME, "messages": messages, "max_tokens": 8,
                                     "temperature": 0, **body}, cache_salt=salt)


def run_all(engine: RemoteEngine, requests: list[EngineRequest]) -> dict[str, Any]:
    results = {r.request_id: r for r in engine.run(requests)}
    assert sorted(results) == sorted(r.request_id for r in requests)
    return results


def test_every_endpoint_of_a_chat_model(make_engine):
    engine = make_engine()
    results = run_all(engine, [
        chat("c", "Say hi."),
        EngineRequest("p", COMPLETIONS, {"model": NAME, "prompt": "Once upon a time",
                                         "max_tokens": 6, "temperature": 0}),
        EngineRequest("r", RESPONSES, {"model": NAME, "input": "Say hi.",
                                       "max_output_tokens": 16, "temperature": 0}),
        EngineRequest("m", MESSAGES, {"model": NAME, "max_tokens": 8,
                                      "messages": [{"role": "user", "content": "Say hi."}]}),
    ])
    assert {rid: r.status_code for rid, r in results.items()} == dict.fromkeys("cprm", 200)
    assert results["c"].body["object"] == "chat.completion"
    assert results["p"].body["object"] == "text_completion"
    assert results["r"].body["object"] == "response"
    assert results["m"].body["type"] == "message"
    for rid in "cpr":
        assert results[rid].body["model"] == NAME  # our name, not the server's
    URLS = {"c": CHAT, "p": COMPLETIONS, "r": RESPONSES, "m": MESSAGES}  # noqa: N806
    for rid in "cprm":
        prompt, output, _cached = usage_of(URLS[rid], results[rid].body)
        assert prompt > 0 and output > 0


def test_cached_tokens_through_the_server_and_the_owners_salt(make_engine):
    engine = make_engine()
    first = run_all(engine, [chat("a", "Hello.", salt="owner-1", system=SYSTEM)])["a"]
    again = run_all(engine, [chat("b", "Hi there.", salt="owner-1", system=SYSTEM)])["b"]
    other = run_all(engine, [chat("c", "Hey.", salt="owner-2", system=SYSTEM)])["c"]
    assert usage_of(CHAT, first.body)[2] == 0
    assert usage_of(CHAT, again.body)[2] >= 128  # the shared system prompt, from the cache
    assert usage_of(CHAT, other.body)[2] == 0  # another owner's salt: nothing shared


def test_faults_change_no_answer(make_engine, proxy):
    requests = [chat(f"q{i}", f"Name a colour, number {i}.") for i in range(6)]
    clean = run_all(make_engine(), requests)
    proxy.faults += [("status", 429, 1), ("status", 503, None), ("reset",), ("slow", 3.0)]
    engine = make_engine(request_timeout=2.0)
    faulty = run_all(engine, requests)
    text = {rid: r.body["choices"][0]["message"]["content"] for rid, r in clean.items()}
    assert {rid: r.body["choices"][0]["message"]["content"] for rid, r in faulty.items()
            } == text
    assert server_state(redis.Redis.from_url(REDIS_URL), proxy.url, ceiling=4).backoffs >= 4


def test_a_bad_request_is_the_servers_error_and_not_retried(make_engine, proxy):
    engine = make_engine()
    [result] = engine.run([chat("x", "Hello.", max_tokens=100_000)])
    assert result.status_code == 400
    assert "max_model_len=512" in result.body["error"]["message"]  # the server's words
    assert proxy.posts == ["/v1/chat/completions"]


def test_abort_ends_the_request_on_the_server(make_engine, smol_server):
    # Straight to the server: the proxy would hold its own connection to it open.
    engine = make_engine(base_url=smol_server.url)
    stream = engine.run([chat("long", "Write a long story about a cat.", max_tokens=480,
                              ignore_eos=True)])
    threading.Timer(1.0, engine.abort, args=(["long"],)).start()
    [result] = list(stream)
    assert result.aborted

    def server_queue() -> tuple[float, float]:
        text = httpx.get(f"http://127.0.0.1:{smol_server.port}/metrics").text
        found = vllm_queue(text, "smol")
        assert found is not None
        return found

    # 480 tokens take the server well over 3 s; aborted, it is idle at once.
    deadline = time.monotonic() + 3
    while server_queue() != (0.0, 0.0) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server_queue() == (0.0, 0.0)
