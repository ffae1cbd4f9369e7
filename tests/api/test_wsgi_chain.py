"""The WSGI application Granian serves (batchweb.wsgi) answers the API (/v1/) through a
shorter middleware chain than pages: every answer is the one the whole chain gives
(status, headers, body), and pages keep every middleware (sign-in, CSRF)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.handlers.wsgi import WSGIHandler
from django.http import HttpResponse

from batchweb.wsgi import Handler, application
from tests.factories import claimed_batch, wsgi_call

pytestmark = pytest.mark.django_db


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
        ours, theirs = (wsgi_call(app, method, path, headers) for app in (application, whole))
        assert ours[0].startswith(status), (method, path, ours)
        assert ours == theirs, (method, path)
    first = wsgi_call(application, "GET", f"/v1/batches/{batch.pk}", auth)
    assert first[0].startswith("200"), first
    etag = first[1]["ETag"]
    status, headers, body = wsgi_call(application, "GET", f"/v1/batches/{batch.pk}",
                                  {**auth, "If-None-Match": etag})
    assert status.startswith("304") and body == b"" and headers["X-Frame-Options"] == "DENY"
    # A POST needs no CSRF token (the key is the credential) and sets no cookie.
    status, headers, body = wsgi_call(application, "POST", f"/v1/batches/{batch.pk}/cancel", auth)
    assert status.startswith("200") and json.loads(body)["status"] == "cancelling"
    assert "Set-Cookie" not in headers


def test_pages_keep_every_middleware(user):
    status, headers, _ = wsgi_call(application, "GET", "/")
    assert status.startswith("302") and "/accounts/login/" in headers["Location"]
    status, headers, _ = wsgi_call(application, "GET", "/accounts/login/")
    assert status.startswith("200") and "csrftoken" in headers.get("Set-Cookie", "")
    # A form POST without its CSRF token is refused.
    status, _, _ = wsgi_call(application, "POST", "/accounts/login/", body=b"username=a")
    assert status.startswith("403")


def test_requests_carry_none_of_the_servers_environment(monkeypatch, user, api_key):
    """Granian copies its process's environment into each request's environ: secrets such
    as DATABASE_URL must not reach request.META (error reports show it)."""
    monkeypatch.setenv("DATABASE_URL", "postgres://user:secret@db/batchweb")
    seen: list[dict] = []
    handler = Handler()
    monkeypatch.setattr(handler.api, "get_response",
                        lambda request: seen.append(dict(request.META)) or HttpResponse())
    wsgi_call(handler, "GET", "/v1/models", {"Authorization": f"Bearer {api_key}",
                                             "X-Custom": "kept"},
              environ={"DATABASE_URL": os.environ["DATABASE_URL"]})
    assert "DATABASE_URL" not in seen[0] and seen[0]["HTTP_X_CUSTOM"] == "kept"
    assert seen[0]["PATH_INFO"] == "/v1/models"


@pytest.mark.processes
def test_the_routes_are_loaded_before_the_first_request() -> None:
    # A fresh interpreter: in this one, earlier tests have resolved URLs already.
    code = ("import sys, batchweb.wsgi; "
            "print(all(m in sys.modules for m in ('batchweb.urls', 'jobs.api.batches')))")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[2],
                          capture_output=True, text=True, check=True)
    assert done.stdout.strip().splitlines()[-1] == "True", done.stderr[-2000:]
