"""A small HTTP server on loopback for the remote engine's tests: it forwards each request
to an upstream OpenAI-compatible server (a real `vllm serve`), or, without one, answers
chat and completions itself in vLLM's shape; either way it injects faults first.

Faults are consumed in order, one per POST, from `faults` (a list the test appends to):
    ("status", 429, retry_after)   answer that status (Retry-After when not None)
    ("reset",)                      close the connection without an answer (RST)
    ("slow", seconds)               wait, then answer as usual
    ("fail_always", status)         every POST from now on answers that status
It counts what passed: POSTs by path, the most requests in flight at once, the bodies
received, and the requests whose client went away before the answer.
"""

from __future__ import annotations

import http.client
import json
import select
import socket
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit


class FaultProxy:
    def __init__(self, upstream: str = "", *, delay: float = 0.0,
                 metrics: str = "", port: int = 0) -> None:
        self.upstream = urlsplit(upstream) if upstream else None
        self.delay = delay  # seconds each self-answered request takes
        self.metrics = metrics  # what GET /metrics answers when there is no upstream
        self.served = ["remote-test"]  # what GET /v1/models lists then
        self.faults: list[tuple[Any, ...]] = []
        self.always: int | None = None
        self.lock = threading.Lock()
        self.in_flight = 0
        self.most_in_flight = 0
        self.posts: list[str] = []
        self.bodies: list[dict[str, Any]] = []
        self.auth: list[str] = []  # each POST's Authorization header
        self.gone = 0  # answers the client was no longer there for
        self.server = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _next_fault(self) -> tuple[Any, ...] | None:
        with self.lock:
            if self.always is not None:
                return ("status", self.always, None)
            if not self.faults:
                return None
            fault = self.faults.pop(0)
            if fault[0] == "fail_always":
                self.always = fault[1]
                return ("status", fault[1], None)
            return fault

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                if proxy.upstream is not None:
                    self._forward(b"")
                    return
                body = proxy.metrics.encode() if self.path == "/metrics" else json.dumps(
                    {"object": "list", "data": [{"id": name} for name in proxy.served]}).encode()
                self._send(200 if self.path != "/metrics" or proxy.metrics else 404, body,
                           "text/plain" if self.path == "/metrics" else "application/json")

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with proxy.lock:
                    proxy.posts.append(self.path)
                    proxy.bodies.append(json.loads(raw or b"{}"))
                    proxy.auth.append(self.headers.get("Authorization", ""))
                    proxy.in_flight += 1
                    proxy.most_in_flight = max(proxy.most_in_flight, proxy.in_flight)
                try:
                    self._post(raw)
                finally:
                    with proxy.lock:
                        proxy.in_flight -= 1

            def _post(self, raw: bytes) -> None:
                fault = proxy._next_fault()
                if fault is not None and fault[0] == "status":
                    _, status, after = fault
                    body = json.dumps({"error": {"message": f"injected {status}",
                                                 "type": "ServerBusy", "code": status}})
                    self._send(status, body.encode(), "application/json",
                               {"Retry-After": str(after)} if after is not None else {})
                    return
                if fault is not None and fault[0] == "reset":
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                               struct.pack("ii", 1, 0))
                    self.connection.close()
                    self.close_connection = True
                    return
                if fault is not None and fault[0] == "slow":
                    time.sleep(fault[1])
                if proxy.upstream is not None:
                    self._forward(raw)
                else:
                    time.sleep(proxy.delay)
                    if self._client_gone():
                        with proxy.lock:
                            proxy.gone += 1
                        self.close_connection = True
                        return
                    self._send(200, json.dumps(_answer(self.path, json.loads(raw))).encode(),
                               "application/json")

            def _client_gone(self) -> bool:
                """Whether the client closed the connection while its answer was made (a
                write would still succeed: the kernel takes it before the reset comes)."""
                readable, _, _ = select.select([self.connection], [], [], 0)
                if not readable:
                    return False
                try:
                    return self.connection.recv(1, socket.MSG_PEEK) == b""
                except OSError:
                    return True

            def _forward(self, raw: bytes) -> None:
                assert proxy.upstream is not None
                conn = http.client.HTTPConnection(proxy.upstream.hostname,
                                                  proxy.upstream.port, timeout=600)
                try:
                    conn.request(self.command, self.path, body=raw or None, headers={
                        "Content-Type": "application/json"})
                    response = conn.getresponse()
                    body = response.read()
                finally:
                    conn.close()
                self._send(response.status, body,
                           response.getheader("Content-Type", "application/json"))

            def _send(self, status: int, body: bytes, kind: str,
                      headers: dict[str, str] | None = None) -> None:
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", kind)
                    self.send_header("Content-Length", str(len(body)))
                    for name, value in (headers or {}).items():
                        self.send_header(name, value)
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:
                    with proxy.lock:
                        proxy.gone += 1

        return Handler


def _answer(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """A chat or completions answer in vLLM's shape: the last user text back."""
    text = "ok"
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        text = str(messages[-1].get("content"))
    words = len(text.split())
    usage = {"prompt_tokens": words, "completion_tokens": words,
             "total_tokens": 2 * words, "prompt_tokens_details": {"cached_tokens": 0}}
    if path.endswith("/completions") and "chat" not in path:
        return {"id": "cmpl-1", "object": "text_completion", "model": body.get("model"),
                "choices": [{"index": 0, "text": text, "finish_reason": "stop"}],
                "usage": usage}
    return {"id": "chatcmpl-1", "object": "chat.completion", "model": body.get("model"),
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": text}}],
            "usage": usage}
