"""The remote engine's limit, backoff and retries against a real HTTP server of the tests'
own (tests/faultproxy.py answering chat itself) and the Redis of the test run: the shared
semaphore, AIMD, Retry-After, failures that end as failed requests, aborts, a server that
is not there yet."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from engine.base import EngineError, EngineRequest, ModelSpec
from engine.endpoints import CHAT, MESSAGES
from engine.remote import RemoteEngine, backoff_seconds, retry_after, vllm_queue
from engine.remote_limits import ACQUIRE, keys, server_state
from tests.factories import free_port, wait_for
from tests.faultproxy import FaultProxy

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest.fixture
def proxies(starts_processes: None) -> Iterator[list[FaultProxy]]:
    made: list[FaultProxy] = []
    yield made
    for proxy in made:
        proxy.close()


@pytest.fixture
def engines(starts_processes: None) -> Iterator[list[RemoteEngine]]:
    made: list[RemoteEngine] = []
    yield made
    for engine in made:
        engine.close()


def make_proxy(proxies: list[FaultProxy], **kwargs: Any) -> FaultProxy:
    proxy = FaultProxy(**kwargs)
    proxies.append(proxy)
    return proxy


def make_engine(engines: list[RemoteEngine], url: str, **options: Any) -> RemoteEngine:
    defaults = {"base_url": url, "redis_url": REDIS_URL, "backoff_base": 0.05,
                "metrics_url": ""}
    engine = RemoteEngine(ModelSpec(name="remote-test", backend="remote",
                                    options={**defaults, **options}))
    engines.append(engine)
    return engine


def chat(request_id: str, text: str = "hello there", **body: Any) -> EngineRequest:
    return EngineRequest(request_id=request_id, url=CHAT, body={
        "model": "remote-test", "messages": [{"role": "user", "content": text}], **body})


def state(url: str, ceiling: float = 64) -> Any:
    return server_state(redis.Redis.from_url(REDIS_URL), url, ceiling=ceiling)


def test_answers_carry_the_model_name_here_and_send_priority_and_salt(proxies, engines):
    proxy = make_proxy(proxies)
    proxy.served = ["served-name"]
    engine = make_engine(engines, proxy.url, model="served-name", priority=7)
    req = EngineRequest(request_id="a", url=CHAT, cache_salt="owner-salt", body={
        "model": "remote-test", "messages": [{"role": "user", "content": "two words"}]})
    [result] = list(engine.run([req]))
    assert result.status_code == 200
    assert result.body["model"] == "remote-test"
    assert result.body["choices"][0]["message"]["content"] == "two words"
    sent = proxy.bodies[0]
    assert (sent["model"], sent["priority"], sent["cache_salt"]) == (
        "served-name", 7, "owner-salt")
    assert proxy.posts == ["/v1/chat/completions"]


def test_the_api_key_comes_from_the_named_variable(proxies, engines, monkeypatch):
    proxy = make_proxy(proxies)
    with pytest.raises(EngineError, match="REMOTE_TEST_KEY is not set"):
        make_engine(engines, proxy.url, api_key_env="REMOTE_TEST_KEY")
    monkeypatch.setenv("REMOTE_TEST_KEY", "sk-remote")
    list(make_engine(engines, proxy.url, api_key_env="REMOTE_TEST_KEY").run([chat("a")]))
    assert proxy.auth == ["Bearer sk-remote"]


def test_a_server_without_the_model_is_refused_at_start(proxies, engines):
    proxy = make_proxy(proxies)
    proxy.served = ["another-model"]
    with pytest.raises(EngineError, match="not 'remote-test'"):
        make_engine(engines, proxy.url)
    with pytest.raises(EngineError, match="unknown remote option"):
        make_engine(engines, proxy.url, max_concurency=3)


@pytest.mark.parametrize("lease", [1, 0, -5, "30", True, float("inf")])
def test_a_bad_lease_is_refused_by_name(proxies, engines, lease):
    proxy = make_proxy(proxies)
    with pytest.raises(EngineError, match="lease_seconds must be seconds above 1"):
        make_engine(engines, proxy.url, lease_seconds=lease)


def test_messages_go_without_priority(proxies, engines):
    proxy = make_proxy(proxies)
    engine = make_engine(engines, proxy.url)
    req = EngineRequest(request_id="m", url=MESSAGES, body={
        "model": "remote-test", "max_tokens": 5,
        "messages": [{"role": "user", "content": "hi"}]})
    list(engine.run([req]))
    assert proxy.posts == ["/v1/messages"] and "priority" not in proxy.bodies[0]


def test_in_flight_never_above_the_ceiling_shared_by_two_engines(proxies, engines):
    proxy = make_proxy(proxies, delay=0.15)
    a = make_engine(engines, proxy.url, max_concurrency=3, initial_concurrency=3)
    b = make_engine(engines, proxy.url, max_concurrency=3, initial_concurrency=3)
    results: dict[str, list[int]] = {}

    def drive(engine: RemoteEngine, name: str) -> None:
        results[name] = [r.status_code for r in engine.run(
            chat(f"{name}{i}") for i in range(12))]

    threads = [threading.Thread(target=drive, args=(e, n)) for e, n in ((a, "a"), (b, "b"))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert results == {"a": [200] * 12, "b": [200] * 12}
    assert proxy.most_in_flight == 3
    assert state(proxy.url).in_flight == 0  # every lease given back


def test_a_dead_holders_slots_come_back(proxies, engines):
    proxy = make_proxy(proxies)
    engine = make_engine(engines, proxy.url, max_concurrency=2, initial_concurrency=2)
    # Another worker took both slots and was killed: its leases are never renewed.
    client = redis.Redis.from_url(REDIS_URL)
    acquire = client.register_script(ACQUIRE)
    assert [acquire(keys=list(keys(proxy.url)), args=[f"dead{i}", 1500, 2, 2])
            for i in range(2)] == [1, 1]
    assert state(proxy.url).in_flight == 2
    started = time.monotonic()
    [result] = list(engine.run([chat("x")]))
    waited = time.monotonic() - started
    assert result.status_code == 200
    assert 1.0 < waited < 5.0


def test_a_lease_lasts_the_models_lease_seconds(proxies, engines):
    proxy = make_proxy(proxies)
    proxy.delay = 1.0
    engine = make_engine(engines, proxy.url, lease_seconds=4)
    client = redis.Redis.from_url(REDIS_URL)
    running = threading.Thread(target=lambda: list(engine.run([chat("x")])), daemon=True)
    running.start()
    wait_for(lambda: state(proxy.url).in_flight == 1, timeout=10, every=0.02,
             message="the request's slot")
    [(_, expires_ms)] = client.zrange(keys(proxy.url)[0], 0, -1, withscores=True)
    now_s, now_us = client.time()
    assert 3000 < expires_ms - (now_s * 1000 + now_us / 1000) <= 4000
    running.join(timeout=10)


def test_429_waits_its_retry_after_and_cuts_the_limit(proxies, engines):
    proxy = make_proxy(proxies)
    proxy.faults += [("status", 429, 1), ("status", 503, 1)]
    engine = make_engine(engines, proxy.url, max_concurrency=8, initial_concurrency=8)
    started = time.monotonic()
    [result] = list(engine.run([chat("x")]))
    assert result.status_code == 200
    assert time.monotonic() - started >= 2.0  # one Retry-After each
    assert len(proxy.posts) == 3
    seen = state(proxy.url)
    assert seen.backoffs == 2 and seen.errors == 0
    # 8 halved once (the second cut came within the cooldown), then + 1/limit per success.
    assert seen.cuts == 1 and 4 <= seen.limit < 5
    assert seen.condition == "busy"


def test_a_request_that_keeps_failing_ends_failed_with_the_servers_error(proxies, engines):
    proxy = make_proxy(proxies)
    proxy.faults.append(("fail_always", 503))
    engine = make_engine(engines, proxy.url, max_retries=2)
    results = list(engine.run([chat("x"), chat("y")]))
    assert sorted(r.request_id for r in results) == ["x", "y"]
    for result in results:
        assert result.status_code == 503
        assert result.body["error"]["message"] == "injected 503"
    assert len(proxy.posts) == 6  # each: the first attempt and two retries, no more
    assert state(proxy.url).errors == 2


def test_resets_and_timeouts_are_retried(proxies, engines):
    proxy = make_proxy(proxies)
    proxy.faults += [("reset",), ("slow", 1.5)]
    engine = make_engine(engines, proxy.url, request_timeout=0.5)
    [result] = list(engine.run([chat("x")]))
    assert result.status_code == 200
    assert len(proxy.posts) == 3
    assert state(proxy.url).backoffs == 2


def test_the_limit_grows_while_latency_holds(proxies, engines):
    # A server delay well above a loaded machine's scheduling jitter: latency then holds
    # within the tolerance (2x the floor) on a busy machine too.
    proxy = make_proxy(proxies, delay=0.2)
    engine = make_engine(engines, proxy.url, max_concurrency=16, initial_concurrency=1)
    assert all(r.status_code == 200 for r in engine.run(chat(f"r{i}") for i in range(40)))
    assert 8 <= state(proxy.url, 16).limit <= 16  # slow start: +1 a request, no cut yet


def test_vllm_metrics_with_others_waiting_cut_the_limit(proxies, engines):
    metrics = ('vllm:num_requests_running{engine="0",model_name="remote-test"} 4.0\n'
               'vllm:num_requests_waiting{engine="0",model_name="remote-test"} 3.0\n')
    proxy = make_proxy(proxies, delay=1.5, metrics=metrics)
    engine = make_engine(engines, proxy.url, max_concurrency=8, initial_concurrency=8,
                         metrics_url=f"http://127.0.0.1:{proxy.port}/metrics",
                         metrics_interval=0.2)
    list(engine.run([chat("x"), chat("y")]))  # 2 ours; the server holds 7
    seen = state(proxy.url)
    assert seen.cuts >= 1 and seen.limit < 5 and seen.condition == "busy"


def test_abort_cancels_the_request_in_flight(proxies, engines):
    proxy = make_proxy(proxies, delay=3.0)
    engine = make_engine(engines, proxy.url)
    stream = engine.run([chat("x")])
    threading.Timer(0.3, engine.abort, args=(["x"],)).start()
    started = time.monotonic()
    [result] = list(stream)
    assert result.aborted and time.monotonic() - started < 2.0
    assert state(proxy.url).in_flight == 0
    time.sleep(3.0)
    assert proxy.gone == 1  # the server's answer found the connection closed


def test_close_ends_a_loop_that_swallowed_its_cancellation(proxies, engines):
    # As a loop does that logs an error and goes on, where redis-py turned the cancellation
    # of its call into an error of its own: close cancels it again, not waiting 10 s for it.
    engine = make_engine(engines, make_proxy(proxies).url)

    async def goes_on() -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(60)
        await asyncio.sleep(60)

    async def start() -> None:
        engine._background.append(asyncio.get_running_loop().create_task(goes_on()))

    engine._call(start())
    started = time.monotonic()
    engine.close()
    assert time.monotonic() - started < 5
    assert engine._background[-1].cancelled()


def test_a_server_not_there_yet_is_waited_for(proxies, engines):
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1"
    engine = make_engine(engines, url, backoff_max=0.3)
    results: list[Any] = []
    thread = threading.Thread(target=lambda: results.extend(engine.run([chat("x")])))
    thread.start()
    time.sleep(1.0)
    assert state(url).condition == "unreachable" and not results
    make_proxy(proxies, port=port)
    thread.join(timeout=10)
    assert [r.status_code for r in results] == [200]
    assert state(url).condition == "ok"


def test_retry_after_and_backoff():
    assert retry_after("3") == 3.0 and retry_after(None) == 0.0 and retry_after("x") == 0.0
    assert all(0 <= backoff_seconds(n, base=0.5, cap=4) <= 4 for n in range(20))
    assert backoff_seconds(0, base=0.5, cap=4, asked=2.5) >= 2.5


def test_vllm_queue_reads_its_own_model_only():
    text = ("# HELP vllm:num_requests_waiting x\n"
            'vllm:num_requests_waiting{engine="0",model_name="a"} 2.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="b"} 5.0\n'
            'vllm:num_requests_running{engine="0",model_name="a"} 3.0\n')
    assert vllm_queue(text, "a") == (3.0, 2.0)
    assert vllm_queue("other 1\n", "a") is None
