"""Every answer under /v1/ is an API's JSON error object, never one of Django's HTML pages:
an unknown path (OpenAI's "Invalid URL" 404, Anthropic's not_found_error under its
Message Batches paths), whatever the method or key, a body over the size limit, and an
error raised outside any view."""

from __future__ import annotations

import json

import httpx
import pytest
import requests
from django.test import Client, override_settings

from batchweb.wsgi import application
from tests.factories import lazy_import, wsgi_call

anthropic = lazy_import("anthropic")
openai = lazy_import("openai")

pytestmark = pytest.mark.django_db(transaction=True)


def test_an_unknown_path_is_openais_404_through_its_client(openai_client):
    with pytest.raises(openai.NotFoundError) as caught:
        openai_client.get("/fine_tuning/jobs", cast_to=httpx.Response)
    assert caught.value.status_code == 404
    assert caught.value.body == {"message": "Invalid URL (GET /v1/fine_tuning/jobs)",
                                 "type": "invalid_request_error", "param": None, "code": None}
    with pytest.raises(openai.NotFoundError):
        openai_client.post("/batches/x/y/z", cast_to=httpx.Response, body={})


def test_an_unknown_anthropic_path_is_anthropics_404_through_its_client(anthropic_client):
    # The Messages API itself is not served (batches only): Anthropic's shape still.
    with pytest.raises(anthropic.NotFoundError) as caught:
        anthropic_client.messages.create(model="echo-test", max_tokens=8, messages=[
            {"role": "user", "content": "hi"}])
    assert caught.value.body == {"type": "error", "error": {
        "type": "not_found_error", "message": "Invalid URL (POST /v1/messages)"}}
    with pytest.raises(anthropic.NotFoundError) as caught:
        anthropic_client.get("/v1/messages/batches/x/y", cast_to=httpx.Response)
    assert caught.value.body["error"]["type"] == "not_found_error"


@pytest.mark.parametrize(("method", "path", "headers"), [
    ("GET", "/v1/nothing", {}),
    ("POST", "/v1/nothing", {"Content-Type": "application/json"}),  # no CSRF page either
    ("DELETE", "/v1/files/x/y", {"Authorization": "Bearer sk-bw-wrong"}),
    ("GET", "/v1/batches/", {}),
    ("PUT", "/v1/", {}),
])
def test_every_unknown_path_of_the_openai_face_is_json(live_server, method, path, headers):
    response = requests.request(method, live_server.url + path, headers=headers, data=b"{}")
    assert response.status_code == 404
    assert response.headers["Content-Type"] == "application/json"
    assert response.json()["error"]["message"] == f"Invalid URL ({method} {path})"


def test_pages_keep_djangos_404(client):
    response = client.get("/no-such-page/")
    assert response.status_code == 404
    assert response["Content-Type"].startswith("text/html")


def test_the_whole_and_the_api_chain_answer_an_unknown_path_alike(api_key):
    status, headers, body = wsgi_call(application, "POST", "/v1/messages/batches/a/b/c",
                                      {"x-api-key": api_key})
    assert status.startswith("404") and headers["Content-Type"] == "application/json"
    assert b'"not_found_error"' in body


def test_a_body_over_the_limit_is_413_in_each_apis_shape(live_server, settings):
    settings.BATCHWEB = {**settings.BATCHWEB, "MAX_FILE_BYTES": 1000,
                         "MAX_UPLOAD_PART_BYTES": 1000, "MESSAGE_BATCH_MAX_BYTES": 1000}
    huge = b"x" * (3 * 1024 * 1024)
    openai_face = requests.post(f"{live_server.url}/v1/files", data=huge)
    assert openai_face.status_code == 413
    assert openai_face.json()["error"]["code"] == "file_too_large"
    anthropic_face = requests.post(f"{live_server.url}/v1/messages/batches", data=huge)
    assert anthropic_face.status_code == 413
    assert anthropic_face.json()["type"] == "error"
    assert anthropic_face.json()["error"]["type"] == "request_too_large"


@override_settings(ROOT_URLCONF="tests.api.failing_urls")
def test_an_error_outside_any_view_is_the_apis_500():
    client = Client(raise_request_exception=False)
    openai_face = client.get("/v1/boom")
    assert openai_face.status_code == 500
    assert openai_face.json()["error"]["type"] == "server_error"
    anthropic_face = client.get("/v1/messages/boom")
    assert anthropic_face.status_code == 500
    assert anthropic_face.json() == {"type": "error", "error": {
        "type": "api_error", "message": "The server failed to handle the request."}}
    page = client.get("/boom")
    assert page.status_code == 500 and page["Content-Type"].startswith("text/html")


@pytest.mark.parametrize(("method", "path"), [
    ("GET", "/v1"), ("POST", "/v1"), ("GET", "/v1?limit=2"), ("HEAD", "/v1"),
    ("GET", "/v1/files/"), ("GET", "/v1/batches/x/cancel/")])
def test_v1_without_its_slash_is_the_apis_404_never_a_redirect(method, path):
    # APPEND_SLASH would answer /v1 with a 301 to /v1/ (text/html): an API path answers
    # in the API's shape, whichever middleware chain serves it.
    status, headers, body = wsgi_call(application, method, path)
    assert status.startswith("404"), (status, headers)
    assert "Location" not in headers
    assert headers["Content-Type"] == "application/json"
    if method != "HEAD":
        error = json.loads(body)["error"]
        assert error["type"] == "invalid_request_error"
        assert error["message"] == f"Invalid URL ({method} {path.partition('?')[0]})"
