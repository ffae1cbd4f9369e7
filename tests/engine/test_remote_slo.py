"""The remote limit steered by an online latency SLO (engine/remote_slo.py), against a real
HTTP server of the test's own whose time to first token rises with the batch requests in
flight, and the Redis of the test run: the limit settles where the SLO holds, reaches the
ceiling where nothing slows down or no online user is there, and stays at the deadline
floor when a batch's window needs it, saying so."""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import redis

from engine import remote_slo
from engine.base import EngineError, EngineRequest, ModelSpec
from engine.endpoints import CHAT, EMBEDDINGS
from engine.remote import RemoteEngine
from engine.remote_limits import keys, server_state, set_floor
from engine.remote_slo import (
    Decision,
    decide,
    parse,
    percentile,
    vllm_successes,
)
from engine.remote_slo import (
    keys as slo_keys,
)

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")


class SlowingServer:
    """An OpenAI-like server: a batch request (not streamed) takes `duration` seconds; a
    streamed request (an online one, the probe) gets its first token after `base` plus
    `per_request` seconds per batch request in flight, as a CPU server's step grows with
    its batch. Its /metrics counts finished requests as vLLM does, plus `online` made-up
    online requests a second."""

    def __init__(self, *, base: float = 0.02, per_request: float = 0.01,
                 duration: float = 0.2, online: float = 5.0) -> None:
        self.base, self.per_request, self.duration = base, per_request, duration
        self.online = online
        self.lock = threading.Lock()
        self.in_flight = 0
        self.finished = 0
        self.online_done = 0.0
        self.started = time.monotonic()
        self.ttfts: list[tuple[float, float]] = []  # (when, seconds) of streamed requests
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def set_online(self, rate: float) -> None:
        with self.lock:
            self.online_done = self._online_now()
            self.started = time.monotonic()
            self.online = rate

    def _online_now(self) -> float:
        return self.online_done + self.online * (time.monotonic() - self.started)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # no 40 ms of delayed ACK in a probe's time

            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, body: bytes, kind: str = "application/json") -> None:
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                if self.path.endswith("/models"):
                    self._send(json.dumps({"data": [{"id": "remote-test"}]}).encode())
                else:
                    with fake.lock:
                        done = fake.finished + int(fake._online_now())
                    self._send((f'vllm:request_success_total{{finished_reason="stop",'
                                f'model_name="remote-test"}} {done}.0\n').encode(),
                               "text/plain")

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if body.get("stream"):
                    return self._stream()
                with fake.lock:
                    fake.in_flight += 1
                # Answers of different lengths: they end spread out, as a batch's do.
                time.sleep(fake.duration * random.uniform(0.5, 1.5))
                with fake.lock:
                    fake.in_flight -= 1
                    fake.finished += 1
                self._send(json.dumps({
                    "id": "x", "object": "chat.completion", "model": "remote-test",
                    "choices": [{"index": 0, "finish_reason": "stop", "message": {
                        "role": "assistant", "content": "ok"}}],
                    "usage": {"prompt_tokens": 5, "completion_tokens": 8,
                              "total_tokens": 13}}).encode())

            def _stream(self) -> None:
                with fake.lock:
                    wait = fake.base + fake.per_request * fake.in_flight
                time.sleep(wait)
                with fake.lock:
                    fake.ttfts.append((time.monotonic(), wait))
                    fake.finished += 1
                chunk = json.dumps({"choices": [{"index": 0, "delta": {"content": "H"}}]})
                self._send(f"data: {chunk}\n\ndata: [DONE]\n\n".encode(), "text/event-stream")

        return Handler


@pytest.fixture
def made() -> Iterator[list[Any]]:
    things: list[Any] = []
    yield things
    for thing in reversed(things):
        thing.close()


def make_server(made: list[Any], **kwargs: Any) -> SlowingServer:
    server = SlowingServer(**kwargs)
    made.append(server)
    client = redis.Redis.from_url(REDIS_URL)
    client.delete(*keys(server.url), *slo_keys(server.url))
    return server


def make_engine(made: list[Any], url: str, **options: Any) -> RemoteEngine:
    defaults = {"base_url": url, "redis_url": REDIS_URL, "max_concurrency": 32,
                "slo_probe_interval": 0.1, "request_timeout": 30}
    engine = RemoteEngine(ModelSpec(name="remote-test", backend="remote",
                                    endpoints=(CHAT,), options={**defaults, **options}))
    made.append(engine)
    return engine


class Drain:
    """Batch requests through the engine in a thread until closed: always more than the
    limit lets in, as a big batch's are."""

    def __init__(self, engine: RemoteEngine) -> None:
        self.engine = engine
        self.sent = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _requests(self) -> Iterator[EngineRequest]:
        while not self.stop.is_set():
            self.sent += 1
            yield EngineRequest(request_id=f"r{self.sent}", url=CHAT, body={
                "model": "remote-test", "messages": [{"role": "user", "content": "hi"}]})

    def _run(self) -> None:
        for _ in self.engine.run(self._requests()):
            pass

    def close(self) -> None:
        self.stop.set()
        # What the engine has taken in but not run yet is aborted, not waited for.
        self.engine.abort([f"r{i}" for i in range(1, self.sent + 1)])
        self.thread.join(timeout=30)


def state(url: str, ceiling: float = 32) -> Any:
    return server_state(redis.Redis.from_url(REDIS_URL), url, ceiling=ceiling)


def wait_for(what: Callable[[], bool], seconds: float = 30.0) -> None:
    """Polls until `what` holds; a convergence bound, not a speed target."""
    deadline = time.monotonic() + seconds
    while not what():
        if time.monotonic() > deadline:
            raise AssertionError("never held")
        time.sleep(0.2)


def limits_over(url: str, seconds: float) -> list[float]:
    seen = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        seen.append(state(url).limit)
        time.sleep(0.1)
    return seen


def test_the_limit_settles_where_the_slo_holds(made):
    # TTFT = 20 ms + 10 ms per batch request in flight: 120 ms holds up to 10 in flight.
    server = make_server(made)
    engine = make_engine(made, server.url, ttft_slo_ms=120)
    made.append(Drain(engine))
    wait_for(lambda: state(server.url).online_ms is not None and len(server.ttfts) > 40)
    seen = limits_over(server.url, 4.0)
    # Never far past the 10 the SLO allows (a loaded test machine's probes may come back
    # slow and cut it lower, which still holds the SLO).
    assert max(seen) <= 12 and min(seen) >= 1, seen
    late = [ttft for when, ttft in server.ttfts if when > time.monotonic() - 3.0]
    assert percentile(late, 90) <= 0.120
    # Between a change of the limit and the next probe back the reason reads "measuring"
    # (no sample under the new limit yet): a loaded machine's probes can be caught there.
    wait_for(lambda: state(server.url).reason == "slo", 10)
    now = state(server.url)
    assert now.slo_ms == 120 and now.slo_percentile == 90
    # The probes' own figure is over the SLO only where a loaded test machine slowed the
    # probes themselves (the server's TTFTs above hold it), and then the limit is cut.
    assert now.online_ms is not None
    assert now.online_ms <= 120 or now.limit < 10, now


def test_a_server_that_does_not_slow_down_reaches_the_ceiling(made):
    server = make_server(made, per_request=0.0)
    # An SLO well above its 20 ms: on a loaded test machine the probes themselves read
    # 80-150 ms, which must not pass for the batch's doing.
    engine = make_engine(made, server.url, ttft_slo_ms=400, max_concurrency=16)
    made.append(Drain(engine))
    wait_for(lambda: state(server.url, 16).limit >= 16
             and state(server.url, 16).slo_ms is not None)
    assert state(server.url, 16).reason == "ceiling"
    assert server.in_flight <= 16


def test_without_online_traffic_the_batch_goes_up_and_comes_back_when_users_return(
        made, monkeypatch):
    # The windows in which online requests are looked for, shortened from 5 and 20 s to
    # the probes' own scale here (0.1 s apart): the rule is the same.
    monkeypatch.setattr(remote_slo, "ONLINE_WINDOW_SECONDS", 1.0)
    monkeypatch.setattr(remote_slo, "ONLINE_HOLD_SECONDS", 3.0)
    server = make_server(made, online=0.0)
    engine = make_engine(made, server.url, ttft_slo_ms=120, max_concurrency=16)
    made.append(Drain(engine))
    # No one to protect (once the first seconds, taken as online, are past): the SLO
    # does not hold the batch back.
    wait_for(lambda: state(server.url, 16).limit >= 16
             and state(server.url, 16).slo_ms is not None, seconds=60)
    assert state(server.url, 16).reason == "ceiling"
    server.set_online(5.0)
    wait_for(lambda: state(server.url, 16).limit <= 12)
    assert state(server.url, 16).reason in ("slo", "measuring")


def test_a_multiple_of_the_time_alone_is_measured_before_the_batch(made):
    server = make_server(made, base=0.04)
    engine = make_engine(made, server.url, ttft_slo_factor=2.0)
    made.append(Drain(engine))
    wait_for(lambda: state(server.url).slo_ms is not None)
    now = state(server.url)
    # 40 ms, and what HTTP and the interpreter lock (the server, the engine's loop and the
    # batch's thread share this process) add to it on a loaded test machine: alone, not
    # with the batch in flight, where it would be 40 ms + 10 ms for each of up to 32.
    assert now.alone_ms is not None and 40 <= now.alone_ms < 150
    assert now.slo_ms == pytest.approx(2 * now.alone_ms, rel=0.01)
    # The SLO holds up to (SLO - 40 ms) / 10 ms batch requests in flight.
    wait_for(lambda: len(server.ttfts) > 60)
    seen = limits_over(server.url, 3.0)
    assert max(seen) <= (now.slo_ms - 40) / 10 + 2, seen


def test_the_deadline_floor_holds_the_limit_above_the_slo_and_says_so(made):
    server = make_server(made)
    client = redis.Redis.from_url(REDIS_URL)
    set_floor(client, server.url, 20.0)
    engine = make_engine(made, server.url, ttft_slo_ms=120)
    made.append(Drain(engine))
    wait_for(lambda: state(server.url).reason == "deadline_floor")
    seen = limits_over(server.url, 2.0)
    assert min(seen) >= 20
    now = state(server.url)
    assert now.slo_traded and now.floor == 20
    assert now.online_ms is not None and now.online_ms > 120  # the SLO given up, visibly
    # The floor gone (no batch due): the SLO takes the limit back down.
    set_floor(client, server.url, 0.0)
    wait_for(lambda: state(server.url).limit <= 12)


def test_without_an_slo_nothing_probes(made):
    server = make_server(made)
    engine = make_engine(made, server.url)
    list(engine.run([EngineRequest(request_id="a", url=CHAT, body={
        "model": "remote-test", "messages": [{"role": "user", "content": "hi"}]})]))
    time.sleep(0.5)
    assert server.ttfts == [] and state(server.url).reason == "adaptive"


@pytest.mark.parametrize(("options", "message"), [
    ({"ttft_slo_ms": 100, "ttft_slo_factor": 2}, "not both"),
    ({"ttft_slo_ms": 0}, "ttft_slo_ms must be milliseconds above 0"),
    ({"ttft_slo_ms": "100"}, "ttft_slo_ms must be"),
    ({"ttft_slo_factor": 1}, "ttft_slo_factor must be a multiple above 1"),
    ({"ttft_slo_ms": 100, "ttft_slo_percentile": 100}, "between 0 and 100"),
    ({"itl_slo_ms": 50}, "itl_slo_ms needs ttft_slo_ms"),
    ({"ttft_slo_ms": 100, "slo_band": 1.5}, "slo_band must be"),
    ({"ttft_slo_ms": 100, "online_priority": "high"}, "online_priority must be"),
    ({"ttft_slo_ms": 100, "slo_probe_interval": 0}, "slo_probe_interval must be"),
])
def test_bad_slo_options_are_refused_by_name(options, message):
    with pytest.raises(EngineError, match=message):
        parse("m", options, (CHAT,))


def test_an_slo_needs_a_model_that_generates():
    with pytest.raises(EngineError, match="an SLO needs a model serving"):
        parse("m", {"ttft_slo_ms": 100}, (EMBEDDINGS,))
    slo = parse("m", {"ttft_slo_factor": 1.5}, (CHAT,))
    assert slo is not None and slo.percentile == 90 and slo.factor == 1.5


def test_decisions():
    base = {"samples": 5, "band": 0.8, "ceiling": 32.0, "floor": 0.0, "binding": True,
            "online": True, "slo_limit": None, "latest_over": False}
    assert decide(pressure_now=0.1, limit=8.0, **base) == Decision(9.0, "slo")
    assert decide(pressure_now=0.6, limit=8.0, **base) == Decision(8.0, "slo")
    assert decide(pressure_now=2.0, limit=8.0, **base).limit == 4.0
    assert decide(pressure_now=0.9, limit=8.0, **base).limit < 8.0
    # A cut not felt yet (more in flight than the limit) is not cut again.
    assert decide(pressure_now=2.0, limit=8.0, draining=True, **base).limit == 8.0
    assert decide(pressure_now=2.0, limit=8.0, **{**base, "floor": 6.0}) == Decision(
        6.0, "deadline_floor")
    assert decide(pressure_now=0.1, limit=8.0, **{**base, "binding": False}).limit == 8.0
    assert decide(pressure_now=None, limit=8.0, **{**base, "online": False}) == Decision(
        16.0, "no_online_traffic")
    assert decide(pressure_now=None, limit=32.0, **{**base, "slo_limit": 6.0}).limit == 6.0


def test_vllm_success_count():
    text = ('vllm:request_success_total{finished_reason="stop",model_name="a"} 3.0\n'
            'vllm:request_success_total{finished_reason="length",model_name="a"} 2.0\n'
            'vllm:request_success_total{finished_reason="stop",model_name="b"} 7.0\n')
    assert vllm_successes(text, "a") == 5.0
    assert vllm_successes("other 1\n", "a") is None


@pytest.mark.django_db
def test_the_floor_is_the_concurrency_the_windows_need():
    from django.utils import timezone

    from jobs.capacity import ModelPlan, Planned, Rates, remote_floor
    from jobs.models import Batch

    now = timezone.now()
    # 3,600 engine seconds due in an hour (margin aside): one worker's engine second a
    # second. A request yields a token every 0.5 s; an engine second is 20 tokens: 10 in
    # flight make one engine second a second.
    batch = Batch(expires_at=now + timedelta(hours=1), total=10, completed=0, failed=0)
    plan = ModelPlan(model="m", workers=[], rates=Rates(0.005, 0.05),
                     batches=[Planned(batch, remaining=3600.0)])
    from jobs.capacity import target

    floor = remote_floor(plan, token_seconds=0.5, now=now)
    assert floor == pytest.approx(10 * 3600 / target(batch, now))
    assert remote_floor(plan, token_seconds=0.0, now=now) == 0.0
    plan.batches[0].remaining = 0
    assert remote_floor(plan, token_seconds=0.5, now=now) == 0.0


@pytest.mark.django_db
def test_queue_health_and_metrics_say_the_slo_is_traded_for_a_deadline(made, admin_client,
                                                                       settings):
    from tests.factories import prometheus_values

    server = make_server(made)
    settings.BATCHWEB_MODELS = [*settings.BATCHWEB_MODELS, {
        "name": "remote-test", "backend": "remote", "endpoints": [CHAT],
        "options": {"base_url": server.url, "max_concurrency": 32, "ttft_slo_ms": 120}}]
    set_floor(redis.Redis.from_url(REDIS_URL), server.url, 20.0)
    made.append(Drain(make_engine(made, server.url, ttft_slo_ms=120)))
    # Held at the floor while the probes measure past the SLO: the SLO traded.
    wait_for(lambda: state(server.url).reason == "deadline_floor"
             and (state(server.url).online_ms or 0) > 120)

    values = prometheus_values(admin_client.get("/metrics").content.decode())
    label = (("server", server.url),)
    assert values[("batchweb_remote_limit_reason", (("reason", "deadline_floor"),
                                                    ("server", server.url)))] == 1
    assert values[("batchweb_remote_limit_reason", (("reason", "slo"),
                                                    ("server", server.url)))] == 0
    assert values[("batchweb_remote_ttft_slo_seconds", label)] == pytest.approx(0.12)
    assert values[("batchweb_remote_ttft_slo_percentile", label)] == 90
    assert values[("batchweb_remote_deadline_floor", label)] == 20
    assert values[("batchweb_remote_online_ttft_seconds", label)] > 0
    assert values[("batchweb_remote_limit", label)] >= 20

    page = admin_client.get("/admin/jobs/shard/health/").content.decode()
    assert "SLO traded for a deadline" in page and "120 ms p90" in page


@pytest.mark.django_db
def test_the_reconcilers_pass_writes_each_servers_floor(settings):
    from django.utils import timezone

    from jobs.capacity import ModelPlan, Planned, Rates
    from jobs.models import Batch
    from jobs.services.deadlines import publish_remote_floors

    url = "http://127.0.0.1:9/v1"
    client = redis.Redis.from_url(settings.REDIS_URL)
    client.delete(*keys(url))
    settings.BATCHWEB_MODELS = [*settings.BATCHWEB_MODELS, {
        "name": "remote-floor", "backend": "remote", "endpoints": [CHAT],
        "options": {"base_url": url, "ttft_slo_ms": 100}}]
    client.hset(keys(url)[1], "token_seconds", "0.5")
    now = timezone.now()
    batch = Batch(expires_at=now + timedelta(hours=1), total=10, completed=0, failed=0)
    plan = ModelPlan(model="remote-floor", workers=[], rates=Rates(0.005, 0.05),
                     batches=[Planned(batch, remaining=3600.0)])
    publish_remote_floors([plan], now=now)
    assert float(client.hget(keys(url)[1], "floor")) > 10  # 10 for an hour, less margin
    publish_remote_floors([], now=now)  # nothing running: no floor
    assert float(client.hget(keys(url)[1], "floor")) == 0
