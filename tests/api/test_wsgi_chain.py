"""The WSGI application Granian serves (batchweb.wsgi) answers the API (/v1/) through a
shorter middleware chain than pages: every answer is the one the whole chain gives
(status, headers, body), and pages keep every middleware (sign-in, CSRF)."""

from __future__ import annotations

import io
import json
import sys
from typing import Any

import pytest
from django.core.handlers.wsgi import WSGIHandler
from django.core.signals import request_finished, request_started
from django.db import close_old_connections

from batchweb.wsgi import application
from tests.factories import claimed_batch

pytestmark = pytest.mark.django_db


def _call(app: Any, method: str, path: str, headers: dict[str, str] | None = None,
          body: bytes = b"") -> tuple[str, dict[str, str], bytes]:
    environ = {"REQUEST_METHOD": method, "PATH_INFO": path.partition("?")[0],
               "QUERY_STRING": path.partition("?")[2], "SERVER_NAME": "testserver",
               "SERVER_PORT": "80", "HTTP_HOST": "testserver", "wsgi.url_scheme": "http",
               "wsgi.input": io.BytesIO(body), "wsgi.errors": sys.stderr,
               "SERVER_PROTOCOL": "HTTP/1.1", "REMOTE_ADDR": "127.0.0.1",
               "CONTENT_LENGTH": str(len(body)), "CONTENT_TYPE": "application/json",
               "wsgi.multithread": True, "wsgi.multiprocess": True, "wsgi.run_once": False,
               "wsgi.version": (1, 0), **{f"HTTP_{k.upper().replace('-', '_')}": v
                                          for k, v in (headers or {}).items()}}
    answer: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None
                       ) -> Any:
        answer.update(status=status, headers=dict(headers))

    # As Django's test client does: the test's database connection (and its transaction)
    # must outlive the request.
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    try:
        result = app(environ, start_response)
        content = b"".join(result)
        result.close()
    finally:
        request_started.connect(close_old_connections)
        request_finished.connect(close_old_connections)
    return answer["status"], answer["headers"], content


def test_api_answers_are_the_whole_chains(user, api_key, tmp_path, settings):
    batch, _ = claimed_batch(user, tmp_path, settings)
    whole = WSGIHandler()
    auth = {"Authorization": f"Bearer {api_key}"}
    requests = [("GET", f"/v1/batches/{batch.pk}", auth, "200"),
                ("GET", "/v1/batches?limit=2", auth, "200"), ("GET", "/v1/models", auth, "200"),
                ("GET", "/v1/batches/batch_none", auth, "404"),
                ("GET", f"/v1/batches/{batch.pk}", {}, "401"),
                ("DELETE", "/v1/models", auth, "405"), ("GET", "/v1/nothing-here", auth, "404")]
    for method, path, headers, status in requests:
        ours, theirs = (_call(app, method, path, headers) for app in (application, whole))
        assert ours[0].startswith(status), (method, path, ours)
        assert ours == theirs, (method, path)
    first = _call(application, "GET", f"/v1/batches/{batch.pk}", auth)
    assert first[0].startswith("200"), first
    etag = first[1]["ETag"]
    status, headers, body = _call(application, "GET", f"/v1/batches/{batch.pk}",
                                  {**auth, "If-None-Match": etag})
    assert status.startswith("304") and body == b"" and headers["X-Frame-Options"] == "DENY"
    # A POST needs no CSRF token (the key is the credential) and sets no cookie.
    status, headers, body = _call(application, "POST", f"/v1/batches/{batch.pk}/cancel", auth)
    assert status.startswith("200") and json.loads(body)["status"] == "cancelling"
    assert "Set-Cookie" not in headers


def test_pages_keep_every_middleware(user):
    status, headers, _ = _call(application, "GET", "/")
    assert status.startswith("302") and "/accounts/login/" in headers["Location"]
    status, headers, _ = _call(application, "GET", "/accounts/login/")
    assert status.startswith("200") and "csrftoken" in headers.get("Set-Cookie", "")
    # A form POST without its CSRF token is refused.
    status, _, _ = _call(application, "POST", "/accounts/login/", body=b"username=a")
    assert status.startswith("403")
