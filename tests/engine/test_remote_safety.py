"""What a remote server, broken or hostile, cannot make the remote engine do: park a request
for ever with its Retry-After, make the worker hold an unbounded body, read its own URL or
an exception's text back from a user's error line, or have the server's key sent where it
does not belong (another origin, plain http off this host); and the prefix cache shared
between owners only where the options say so in those words."""

from __future__ import annotations

import email.utils
import gzip
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from engine.base import EngineError, EngineRequest, EngineResult, ModelSpec
from engine.endpoints import CHAT
from engine.remote import (
    MAX_PAGE_BYTES,
    RemoteEngine,
    backoff_seconds,
    check_key_transport,
    retry_after,
)
from tests.engine.test_remote_limits import REDIS_URL, chat, state
from tests.faultproxy import FaultProxy

# What no error line may carry: the server's address, and the shapes of exception reprs.
LEAKS = ("127.0.0.1", "http://", "Error(", "Exception(", "internal-gpu", "/srv/")


class Server:
    """An HTTP server on loopback that answers as the test says and remembers every
    request's method, path and Authorization header. `post` and `metrics` are handlers:
    (status, headers, body), the body bytes or an iterator of chunks (sent chunked)."""

    Answer = tuple[int, dict[str, str], Any]

    def __init__(self) -> None:
        self.delay = 0.0  # seconds each POST takes
        self.closed = threading.Event()
        self.seen: list[tuple[str, str, str]] = []
        self.accept_encoding: list[str] = []
        self.post: Callable[[], Server.Answer] = lambda: (200, {}, json.dumps(_chat()).encode())
        self.metrics: Callable[[], Server.Answer] = lambda: (404, {}, b"")
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.closed.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def auth(self, method: str, path: str) -> list[str]:
        return [a for m, p, a in self.seen if (m, p) == (method, path)]

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _note(self) -> None:
                server.seen.append((self.command, self.path,
                                    self.headers.get("Authorization", "")))
                server.accept_encoding.append(self.headers.get("Accept-Encoding", ""))

            def do_GET(self) -> None:
                self._note()
                if self.path == "/metrics":
                    self._send(*server.metrics())
                else:
                    self._send(200, {}, json.dumps({"data": [{"id": "remote-test"}]}).encode())

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self._note()
                time.sleep(server.delay)
                self._send(*server.post())

            def _send(self, status: int, headers: dict[str, str], body: Any) -> None:
                try:
                    self.send_response(status)
                    for name, value in {"Content-Type": "application/json", **headers}.items():
                        self.send_header(name, value)
                    if isinstance(body, bytes):
                        self.send_header("Content-Length", str(len(body)))
                        self.end_headers()
                        self.wfile.write(body)
                        return
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    for chunk in body:
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.write(b"0\r\n\r\n")
                except OSError:  # the client stopped reading: what the bound is for
                    self.close_connection = True

        return Handler


def _chat() -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion", "model": "remote-test",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "ok"}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


def past(limit: int, server: Server) -> Iterator[bytes]:
    """A body a chunk past `limit` bytes that then stalls, its end never sent: a streamed
    read stops at the bound at once; reading it all before checking would wait until the
    server closes."""
    for _ in range(limit // 65536 + 1):
        yield b"x" * 65536
    server.closed.wait(60)


def wait_for(condition: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


@pytest.fixture
def servers(starts_processes: None) -> Iterator[Callable[[], Server]]:
    made: list[Server] = []

    def make() -> Server:
        made.append(Server())
        return made[-1]

    yield make
    for server in made:
        server.close()


@pytest.fixture
def proxy(starts_processes: None) -> Iterator[FaultProxy]:
    made = FaultProxy()
    yield made
    made.close()


@pytest.fixture
def engine_for(starts_processes: None) -> Iterator[Callable[..., RemoteEngine]]:
    made: list[RemoteEngine] = []

    def make(url: str, **options: Any) -> RemoteEngine:
        made.append(RemoteEngine(ModelSpec(name="remote-test", backend="remote", options={
            "base_url": url, "redis_url": REDIS_URL, "backoff_base": 0.05,
            "metrics_url": "", **options})))
        return made[-1]

    yield make
    for engine in made:
        engine.close()


def run_within(engine: RemoteEngine, requests: list[EngineRequest], seconds: float
               ) -> list[EngineResult]:
    """The results, or a failure (the requests aborted) when they take over `seconds`."""
    results: list[EngineResult] = []
    thread = threading.Thread(target=lambda: results.extend(engine.run(requests)),
                              daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        engine.abort([r.request_id for r in requests])
        thread.join(10)
        pytest.fail(f"the requests still ran after {seconds} s")
    return results


def message(result: EngineResult) -> str:
    return str(result.body["error"]["message"])


def assert_no_leak(text: str, *extra: str) -> None:
    for leak in (*LEAKS, *extra):
        assert leak not in text, (leak, text)


# -- Retry-After ----------------------------------------------------------------------


def test_a_retry_after_of_inf_or_a_billion_waits_no_more_than_backoff_max(proxy,
                                                                           engine_for):
    proxy.faults += [("status", 429, "inf"), ("status", 503, "1e9"),
                     ("status", 429, "Fri, 01 Jan 2100 00:00:00 GMT")]
    engine = engine_for(proxy.url, backoff_max=0.3)
    started = time.monotonic()
    [result] = run_within(engine, [chat("x")], 15)
    assert result.status_code == 200 and len(proxy.posts) == 4
    assert time.monotonic() - started < 5


def test_retry_after_ignores_what_is_not_a_finite_wait_ahead():
    for value in ("inf", "-inf", "nan", "Infinity", "-5", "garbage",
                  "Mon, 01 Jan 2001 00:00:00 GMT", "Mon, 01 Jan 99999 00:00:00 GMT"):
        assert retry_after(value) == 0.0, value
    ahead = email.utils.formatdate(time.time() + 120, usegmt=True)
    assert 115 < retry_after(ahead) <= 120
    assert retry_after("2.5") == 2.5
    assert backoff_seconds(0, base=0.01, cap=2.0, asked=retry_after("1e9")) == 2.0


# -- bounded bodies ----------------------------------------------------------------------


def test_an_answer_past_the_bound_fails_its_request_there(servers, engine_for):
    server = servers()
    server.post = lambda: (200, {}, past(1 << 20, server))
    engine = engine_for(server.url, max_response_bytes=1 << 20)
    [result] = run_within(engine, [chat("x")], 20)
    assert result.status_code == 502
    assert message(result) == ("the model's server answered with a body over 1048576 "
                               "bytes: not read")
    assert server.accept_encoding[-1] == "identity"


def test_a_declared_length_past_the_bound_is_not_read(servers, engine_for):
    server = servers()
    server.post = lambda: (200, {}, json.dumps(_chat()).encode() + b" " * 2048)
    engine = engine_for(server.url, max_response_bytes=1024)
    [result] = run_within(engine, [chat("x")], 20)
    assert result.status_code == 502 and "over 1024 bytes" in message(result)
    # An answer within the bound still passes.
    server.post = lambda: (200, {}, json.dumps(_chat()).encode())
    assert [r.status_code for r in run_within(engine, [chat("y")], 20)] == [200]


def test_a_compressed_answer_is_refused_whatever_it_inflates_to(servers, engine_for):
    server = servers()
    bomb = gzip.compress(b" " * (32 << 20))  # 32 MiB of JSON whitespace in ~32 KiB
    server.post = lambda: (200, {"Content-Encoding": "gzip"}, bomb)
    engine = engine_for(server.url, max_response_bytes=1 << 20)
    [result] = run_within(engine, [chat("x")], 20)
    assert result.status_code == 502 and "gzip-encoded" in message(result)


def test_a_metrics_page_past_the_bound_is_refused_and_logged(servers, engine_for, caplog):
    server = servers()
    server.delay = 3.0  # a request in flight: the engine watches the metrics meanwhile
    server.metrics = lambda: (200, {"Content-Type": "text/plain"},
                              past(MAX_PAGE_BYTES, server))
    engine = engine_for(server.url, metrics_url=None, metrics_interval=0.1)
    with caplog.at_level(logging.WARNING, logger="engine.remote"):
        [result] = run_within(engine, [chat("x")], 20)
    assert result.status_code == 200
    assert f"/metrics refused (a body over {MAX_PAGE_BYTES} bytes)" in caplog.text


# -- error lines --------------------------------------------------------------------------


def test_a_reset_or_a_timeout_names_neither_the_server_nor_the_exception(proxy, engine_for,
                                                                         caplog):
    proxy.faults += [("reset",), ("slow", 1.5)]
    engine = engine_for(proxy.url, max_retries=0, request_timeout=0.5)
    with caplog.at_level(logging.WARNING, logger="engine.remote"):
        results = {r.request_id: r for r in run_within(engine, [chat("a")], 20)}
        results.update({r.request_id: r for r in run_within(engine, [chat("b")], 20)})
    assert (results["a"].status_code, message(results["a"])) == (
        502, "the model's server closed the connection before answering")
    assert (results["b"].status_code, message(results["b"])) == (
        504, "the model's server did not answer in time")
    for result in results.values():
        assert_no_leak(json.dumps(result.body), str(proxy.port))
    # The detail stays where staff look: the worker's log and queue health.
    assert "remote request a failed: http://127.0.0.1" in caplog.text
    assert "remote request b failed: http://127.0.0.1" in caplog.text
    assert state(proxy.url).last_error.startswith(proxy.url)


def test_a_page_that_is_not_an_openai_answer_is_described_not_quoted(servers, engine_for,
                                                                      caplog):
    server = servers()
    page = b"<html>502 Bad Gateway: internal-gpu-7.corp:8000 /srv/vllm/app.py</html>"
    server.post = lambda: (404, {"Content-Type": "text/html"}, page)
    engine = engine_for(server.url)
    with caplog.at_level(logging.WARNING, logger="engine.remote"):
        [result] = run_within(engine, [chat("x")], 20)
    assert result.status_code == 404
    assert message(result) == ("the model's server answered 404 without an OpenAI answer "
                               "or error")
    assert_no_leak(json.dumps(result.body), str(server.port))
    assert "internal-gpu-7.corp" in caplog.text


def test_an_engine_fault_says_nothing_of_the_exception(proxy, engine_for):
    engine = engine_for(proxy.url)

    def broken(req: EngineRequest) -> dict[str, Any]:
        raise RuntimeError("cannot open /srv/batchweb/secret.json on internal-gpu-7")

    engine._body = broken
    [result] = run_within(engine, [chat("x")], 20)
    assert result.status_code == 500
    assert_no_leak(json.dumps(result.body), "secret.json", "RuntimeError")


# -- where the key goes --------------------------------------------------------------------


def test_the_key_goes_to_base_urls_origin_only(servers, engine_for, monkeypatch):
    monkeypatch.setenv("REMOTE_TEST_KEY", "sk-server")
    monkeypatch.setenv("REMOTE_METRICS_KEY", "sk-metrics")
    server, elsewhere = servers(), servers()
    server.delay = 0.5  # a request in flight: the engine watches the metrics meanwhile
    watched = {"metrics_interval": 0.1, "api_key_env": "REMOTE_TEST_KEY"}

    def metrics_read(by: Server, **options: Any) -> list[str]:
        """The Authorization headers of `by`'s /metrics while a request runs."""
        before = len(by.auth("GET", "/metrics"))
        engine = engine_for(server.url, **watched, **options)
        assert [r.status_code for r in run_within(engine, [chat("x")], 20)] == [200]
        assert wait_for(lambda: len(by.auth("GET", "/metrics")) > before, 5)
        return by.auth("GET", "/metrics")[before:]

    assert set(metrics_read(server, metrics_url=None)) == {"Bearer sk-server"}
    assert set(server.auth("POST", "/v1/chat/completions")) == {"Bearer sk-server"}
    assert set(server.auth("GET", "/v1/models")) == {"Bearer sk-server"}
    metrics = f"http://127.0.0.1:{elsewhere.port}/metrics"
    assert set(metrics_read(elsewhere, metrics_url=metrics)) == {""}  # another origin
    assert set(metrics_read(elsewhere, metrics_url=metrics,
                            metrics_api_key_env="REMOTE_METRICS_KEY")) == {"Bearer sk-metrics"}


def test_a_key_over_plain_http_off_this_host_is_refused(proxy, engine_for, monkeypatch):
    monkeypatch.setenv("REMOTE_TEST_KEY", "sk-server")
    with pytest.raises(EngineError, match='"allow_plain_http": true'):
        engine_for("http://192.0.2.1:8000/v1", api_key_env="REMOTE_TEST_KEY",
                   connect_timeout=1)
    with pytest.raises(EngineError, match="metrics_url .* plain http.*allow_plain_http"):
        engine_for(proxy.url, metrics_url="http://metrics.example:9090/metrics",
                   metrics_api_key_env="REMOTE_TEST_KEY")
    # No key, nothing to leak; loopback, nothing leaves the host.
    engine_for(proxy.url, api_key_env="REMOTE_TEST_KEY")
    engine_for(proxy.url.replace("127.0.0.1", "localhost"), api_key_env="REMOTE_TEST_KEY")


def test_plain_http_is_allowed_on_loopback_and_by_the_option_with_a_warning(caplog):
    for url in ("http://127.0.0.1:8000/v1", "http://127.8.0.1/v1", "http://[::1]:8000/v1",
                "http://LOCALHOST:8000/v1", "https://gpu1.example/v1"):
        check_key_transport("m", "base_url", url, allowed=False)
    with pytest.raises(EngineError, match="allow_plain_http"):
        check_key_transport("m", "base_url", "http://10.0.0.5:8000/v1", allowed=False)
    with caplog.at_level(logging.WARNING, logger="engine.remote"):
        check_key_transport("m", "base_url", "http://10.0.0.5:8000/v1", allowed=True)
    assert "plain http to http://10.0.0.5:8000/v1 (allow_plain_http)" in caplog.text


# -- the prefix cache between owners ------------------------------------------------------


def test_sharing_the_prefix_cache_across_owners_is_said_in_those_words(proxy, engine_for,
                                                                       caplog):
    with pytest.raises(EngineError, match='"share_prefix_cache_across_owners": true'):
        engine_for(proxy.url, cache_salt=False)
    req = EngineRequest(request_id="a", url=CHAT, cache_salt="owner-salt", body={
        "model": "remote-test", "messages": [{"role": "user", "content": "hi"}]})
    run_within(engine_for(proxy.url), [req], 20)
    with caplog.at_level(logging.WARNING, logger="engine.remote"):
        shared = engine_for(proxy.url, share_prefix_cache_across_owners=True)
    run_within(shared, [req], 20)
    assert [body.get("cache_salt") for body in proxy.bodies] == ["owner-salt", None]
    assert "owners share the server's prefix cache" in caplog.text
