"""Security: nobody sees what is not theirs (API and dashboard, every endpoint), keys,
CSRF, staff-only pages, hostile content escaped, uploads limited before buffering, files
served only as attachments, RQ jobs carrying ids only, and a clean `check --deploy`."""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings as django_settings
from django.contrib.admin.utils import quote  # ids in admin URLs are quoted
from django.test import Client
from django.urls import URLPattern, reverse

from jobs.models import ApiKey, Batch, File, Shard
from jobs.services.keys import create_api_key, revoke_api_key
from tests.factories import (
    ROOT,
    Api,
    assert_openai_error,
    chat_line,
    db_snapshot,
    jsonl,
    make_batch,
    run_batch,
    storage_snapshot,
    use_private_storage,
)

pytestmark = pytest.mark.django_db

EVIL = '<script>alert("x")</script>'


@pytest.fixture
def people(settings: Any, tmp_path: Path, django_user_model: Any) -> dict[str, Any]:
    """Alice and Bob with keys, Bob with a finished batch (output and error files), an
    upload with a part, and a running batch."""
    storage = use_private_storage(settings, tmp_path)
    alice = django_user_model.objects.create_user("alice", password="pw")
    bob = django_user_model.objects.create_user("bob", password="pw")
    alice_key = create_api_key(owner=alice, name="a")[1]
    bob_key = create_api_key(owner=bob, name="b")[1]
    lines = [chat_line(f"r{i}", f"q {i}") for i in range(3)]
    done = run_batch(make_batch(bob, lines, tmp_path), fails=lambda c: c == "r1")
    running = make_batch(bob, lines, tmp_path)
    bob_api = Api(bob_key)
    upload = bob_api.post_json("/v1/uploads", {"filename": "u.jsonl", "purpose": "batch",
                                               "bytes": 100, "mime_type": "application/jsonl"})
    upload_id = upload.json()["id"]
    from django.core.files.uploadedfile import SimpleUploadedFile

    part = bob_api.post_multipart(f"/v1/uploads/{upload_id}/parts",
                                  {"data": SimpleUploadedFile("p", b"x" * 10)}).json()["id"]
    eval_set = bob_api.post_json("/v1/eval_sets", {
        "name": "private", "rule": "exact", "file_id": bob_api.upload(jsonl([
            {"custom_id": "q", "body": {"messages": [{"role": "user", "content": "hi"}]},
             "expected": "hi"}])).json()["id"]}).json()
    return {"alice": alice, "bob": bob, "alice_key": alice_key, "bob_key": bob_key,
            "done": done, "running": running, "upload": upload_id, "part": part,
            "storage": storage, "eval_set": eval_set}


# --- another user's ids: 404 everywhere ---


def test_every_api_endpoint_gives_404_for_another_users_ids(people: dict) -> None:
    done, running = people["done"], people["running"]
    api = Api(people["alice_key"])
    files = [done.input_file_id, done.output_file_id, done.error_file_id,
             running.input_file_id]
    before = (db_snapshot(), storage_snapshot(people["storage"]))
    calls = []
    for file_id in files:
        calls += [("GET", f"/v1/files/{file_id}", None), ("DELETE", f"/v1/files/{file_id}", None),
                  ("GET", f"/v1/files/{file_id}/content", None),
                  ("POST", "/v1/batches", {"input_file_id": file_id,
                                           "endpoint": "/v1/chat/completions",
                                           "completion_window": "24h"})]
    for batch in (done, running):
        calls += [("GET", f"/v1/batches/{batch.pk}", None),
                  ("POST", f"/v1/batches/{batch.pk}/cancel", {}),
                  ("POST", f"/v1/batches/{batch.pk}/rerun", {})]
    for set_key in (people["eval_set"]["id"], people["eval_set"]["name"]):
        calls += [("GET", f"/v1/eval_sets/{set_key}", None),
                  ("DELETE", f"/v1/eval_sets/{set_key}", None)]
    upload = people["upload"]
    calls += [("POST", f"/v1/uploads/{upload}/parts", "multipart"),
              ("POST", f"/v1/uploads/{upload}/complete", {"part_ids": [people["part"]]}),
              ("POST", f"/v1/uploads/{upload}/cancel", {})]
    for method, path, body in calls:
        if method == "GET":
            response = api.get(path)
        elif method == "DELETE":
            response = api.delete(path)
        elif body == "multipart":
            from django.core.files.uploadedfile import SimpleUploadedFile

            response = api.post_multipart(path, {"data": SimpleUploadedFile("p", b"{}\n")})
        else:
            response = api.post_json(path, body)
        assert_openai_error(response, 404, code="not_found")
        # Same answer as an id that never existed: nothing tells the two apart.
        assert "bob" not in response.content.decode()
    # Lists show none of it, and another user's id is no cursor.
    assert api.get("/v1/files").json()["data"] == []
    assert api.get("/v1/batches").json()["data"] == []
    for path in (f"/v1/batches?after={done.pk}", f"/v1/files?after={done.input_file_id}"):
        assert_openai_error(api.get(path), 400, param="after")
    assert (db_snapshot(), storage_snapshot(people["storage"])) == before


def test_every_message_batches_endpoint_gives_404_for_another_users_ids(people: dict) -> None:
    import io

    from jobs.services.message_batches import create_message_batch
    from jobs.services.validation import run_validation

    bob = people["bob"]
    body = json.dumps({"requests": [{"custom_id": f"r{i}", "params": {
        "model": "echo-test", "max_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}]}} for i in range(2)]}).encode()
    made = [create_message_batch(owner=bob, body=io.BytesIO(body), declared_length=len(body))
            for _ in range(2)]
    run_validation(batch_id=made[0].pk)
    done = run_batch(Batch.objects.get(pk=made[0].pk))
    assert done.is_ended
    api = Api(people["alice_key"])
    before = (db_snapshot(), storage_snapshot(people["storage"]))
    # Bob's Message Batches, ended and validating, and his OpenAI batch: none is Alice's.
    for batch_id in (done.pk, made[1].pk, people["done"].pk):
        for method, path in (("GET", ""), ("DELETE", ""), ("POST", "/cancel"),
                             ("GET", "/results")):
            url = f"/v1/messages/batches/{batch_id}{path}"
            for extra in ({}, {"HTTP_X_API_KEY": people["alice_key"]}):
                if method == "GET":
                    response = api.get(url, **extra)
                elif method == "DELETE":
                    response = api.delete(url)
                else:
                    response = api.post_json(url, {}, **extra)
                assert response.status_code == 404, (url, response.content)
                assert response.json() == {"type": "error", "error": {
                    "type": "not_found_error", "message": f"No such batch: '{batch_id}'"}}
    assert api.get("/v1/messages/batches").json()["data"] == []
    response = api.get(f"/v1/messages/batches?after_id={done.pk}")
    assert response.status_code == 400 and response.json()["error"]["type"] == \
        "invalid_request_error"
    assert (db_snapshot(), storage_snapshot(people["storage"])) == before



# --- what ran a batch: the machines' names are the staff's ---

PROVENANCE = [{
    "engine": {"model": "echo-test", "model_source": "/srv/gpu-models/echo-test",
               "model_sha256": "9f2c" * 16, "engine": "vllm", "engine_version": "0.8.5",
               "dtype": "bfloat16", "parallelism": {"tensor_parallel_size": 2},
               "sampling_defaults": {"temperature": 0.7}, "batchweb_version": "1.4.0"},
    "workers": ["gpu-node-17.48213.echo-test"],
    "adapters": [{"name": "tone", "source": "/srv/gpu-adapters/tone", "sha256": "ab12" * 16},
                 {"name": "pinned", "source": "pypi:tone-lora==1.0", "sha256": "cd34" * 16}]}]
# What names the machine: the worker's host and PID, the folders on it.
MACHINE = ("gpu-node-17", "48213", "/srv/gpu-")


def test_what_ran_a_batch_names_no_machine_but_to_staff(people: dict) -> None:
    import io

    from jobs.services.message_batches import create_message_batch

    bob = people["bob"]
    body = json.dumps({"requests": [{"custom_id": "r0", "params": {
        "model": "echo-test", "max_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}]}}]}).encode()
    message_batch = create_message_batch(owner=bob, body=io.BytesIO(body),
                                         declared_length=len(body))
    batch = people["done"]
    Batch.objects.filter(pk__in=[batch.pk, message_batch.pk]).update(provenance=PROVENANCE)
    api = Api(people["bob_key"])
    answers = [api.get(f"/v1/batches/{batch.pk}"), api.get("/v1/batches"),
               api.get(f"/v1/messages/batches/{message_batch.pk}"),
               api.get("/v1/messages/batches"),
               api.post_json(f"/v1/messages/batches/{message_batch.pk}/cancel", {})]
    for response in answers:
        assert response.status_code == 200, response.content
        text = response.content.decode()
        assert not [m for m in MACHINE if m in text], text
        # The engine record stays: model, hashes, versions, adapters, a pinned source.
        for shown in ("9f2c" * 16, "bfloat16", "0.8.5", "tensor_parallel_size", "temperature",
                      "ab12" * 16, "pypi:tone-lora==1.0"):
            assert shown in text, shown
    entry = answers[0].json()["provenance"]["workers"][0]
    assert set(entry) == {"engine", "adapters"}
    assert entry["engine"]["model_source"] == entry["adapters"][0]["source"] == "local folder"
    # The dashboard's "What ran it": the engine record for the owner, all of it for staff.
    site = Client()
    site.force_login(bob)
    page = site.get(f"/batches/{batch.pk}/").content.decode()
    assert 'id="provenance"' in page and "sha256:9f2c9f2c" in page and "tone" in page
    assert not [m for m in MACHINE if m in page]
    bob.is_staff = True
    bob.save(update_fields=["is_staff"])
    page = site.get(f"/batches/{batch.pk}/").content.decode()
    assert all(m in page for m in MACHINE)


def _dashboard_urls() -> list[URLPattern]:
    from jobs.views.urls import urlpatterns

    return [p for p in urlpatterns if p.pattern.converters]


def test_every_dashboard_page_and_download_gives_404_for_another_users_ids(
        people: dict) -> None:
    done, running = people["done"], people["running"]
    client = Client()
    client.force_login(people["alice"])
    bob_key = ApiKey.objects.get(owner=people["bob"])
    values = {"batch_id": [done.pk, running.pk],
              "file_id": [done.input_file_id, done.output_file_id, done.error_file_id],
              "key_id": [bob_key.pk], "kind": ["input", "output", "errors"],
              # Behind another user's batch id, any run id: the batch is looked up first.
              "run_id": ["evalrun_0"],
              "set_id": [int(people["eval_set"]["id"].removeprefix("evalset_"))]}
    before = (db_snapshot(), storage_snapshot(people["storage"]))
    tried = 0
    for pattern in _dashboard_urls():
        names = list(pattern.pattern.converters)
        combos: list[dict[str, Any]] = [{}]
        for name in names:
            combos = [{**c, name: v} for c in combos for v in values[name]]
        for kwargs in combos:
            url = reverse(pattern.name, kwargs=kwargs)
            statuses = {client.get(url).status_code,
                        client.post(url, {"custom_id": "r0", "verdict": "good"}).status_code}
            # 405 (wrong method) is answered before any lookup; at least one method is a 404.
            assert statuses <= {404, 405} and 404 in statuses, (url, statuses)
            tried += 1
    assert tried >= 25
    assert (db_snapshot(), storage_snapshot(people["storage"])) == before
    for name in ("batch_list", "file_list", "key_list"):
        page = client.get(reverse(name)).content.decode()
        for secret_id in (done.pk, running.pk, done.input_file_id, bob_key.prefix):
            assert secret_id not in page, name


def test_session_cookies_do_not_authenticate_the_api(people: dict) -> None:
    client = Client()
    client.force_login(people["alice"])
    for path in ("/v1/files", "/v1/batches", "/v1/models"):
        assert_openai_error(client.get(path), 401, code="invalid_api_key")
    assert_openai_error(client.post("/v1/batches", {}, content_type="application/json"), 401)


# --- keys ---

API_ENDPOINTS = [
    ("GET", "/v1/files"), ("POST", "/v1/files"), ("GET", "/v1/files/file-x"),
    ("DELETE", "/v1/files/file-x"), ("GET", "/v1/files/file-x/content"),
    ("POST", "/v1/uploads"), ("POST", "/v1/uploads/upload_x/parts"),
    ("POST", "/v1/uploads/upload_x/complete"), ("POST", "/v1/uploads/upload_x/cancel"),
    ("GET", "/v1/batches"), ("POST", "/v1/batches"), ("GET", "/v1/batches/batch_x"),
    ("POST", "/v1/batches/batch_x/cancel"), ("GET", "/v1/models"),
    ("POST", "/v1/batches/batch_x/rerun"), ("GET", "/v1/eval_sets"),
    ("POST", "/v1/eval_sets"), ("GET", "/v1/eval_sets/evalset_1"),
    ("DELETE", "/v1/eval_sets/evalset_1"),
]


def test_revoked_malformed_and_missing_keys_are_401_everywhere(people: dict,
                                                               django_user_model: Any) -> None:
    alice = people["alice"]
    revoked_row, revoked = create_api_key(owner=alice, name="old")
    revoke_api_key(key=revoked_row)
    carol = django_user_model.objects.create_user("carol", password="pw", is_active=False)
    inactive = create_api_key(owner=carol, name="c")[1]
    good = people["alice_key"]
    headers = [None, "", "Bearer", "Bearer ", f"Bearer {revoked}", f"Bearer {inactive}",
               f"Basic {good}", f"Token {good}", f"Bearer {good[:-1]}",
               f"Bearer {good}x", f"Bearer {good[:12]}", "Bearer sk-bw-" + "A" * 43,
               "Bearer sk-bw-" + "A" * 5000, "Bearer " + good.upper(),
               f"Bearer {good[:20]}\x00{good[21:]}", "Bearer sk-bw-é" + "a" * 42,
               f"Bearer {good.replace('sk-bw-', 'sk-')}"]
    client = Client()
    before = db_snapshot()
    for method, path in API_ENDPOINTS:
        for header in headers:
            extra = {} if header is None else {"HTTP_AUTHORIZATION": header}
            response = client.generic(method, path, b"{}", "application/json", **extra)
            assert_openai_error(response, 401, code="invalid_api_key")
    assert db_snapshot() == before


def test_keys_are_stored_hashed_compared_in_constant_time_and_shown_once(
        people: dict, monkeypatch: Any) -> None:
    import hmac

    from jobs.services import keys

    row, secret = create_api_key(owner=people["alice"], name="k")
    assert secret.startswith("sk-bw-") and len(secret) >= 40
    assert row.secret_hash == hashlib.sha256(secret.encode()).hexdigest()
    stored = json.dumps(db_snapshot())
    assert secret not in stored and secret[12:] not in stored
    compared = []
    real = hmac.compare_digest
    monkeypatch.setattr(keys.hmac, "compare_digest",
                        lambda a, b: compared.append((a, b)) or real(a, b))
    assert keys.authenticate_key(secret) is not None
    assert keys.authenticate_key(secret[:-1] + ("A" if secret[-1] != "A" else "B")) is None
    assert compared  # the hashes were compared with hmac.compare_digest

    client = Client()
    client.force_login(people["alice"])
    created = client.post(reverse("key_list"), {"name": "shown-once"})
    shown = re.findall(r"sk-bw-[A-Za-z0-9_\-]{20,}", created.content.decode())
    assert len(set(shown)) == 1
    assert "no-store" in created["Cache-Control"]
    assert shown[0] not in client.get(reverse("key_list")).content.decode()
    assert ApiKey.objects.filter(name="shown-once", secret_hash=hashlib.sha256(
        shown[0].encode()).hexdigest()).exists()


# --- staff-only pages, CSRF ---

STAFF_URLS = ["/admin/", "/admin/jobs/batch/", "/admin/jobs/shard/", "/admin/jobs/file/",
              "/admin/jobs/apikey/", "/admin/jobs/apikey/add/", "/admin/jobs/upload/",
              "/admin/auth/user/", "/admin/rq/", "/admin/rq/queues/0/",
              "/admin/rq/queues/0/failed/", "/admin/rq/queues/0/empty/",
              "/admin/rq/workers/0/", "/admin/rq/stats.json/"]


def test_staff_only_pages_refuse_plain_users_and_strangers(people: dict,
                                                          admin_client: Any) -> None:
    plain = Client()
    plain.force_login(people["alice"])
    for url in STAFF_URLS:
        for client in (plain, Client()):
            response = client.get(url)
            # 401: django-rq's stats.json wants its API token.
            assert response.status_code in (302, 401, 403, 404), (url, response.status_code)
            if response.status_code == 302:
                assert "/admin/login/" in response["Location"], url
            body = response.content.decode()
            assert people["done"].pk not in body and "Queue" not in body[:2000]
        response = plain.post(url, {"action": "delete_selected"})
        assert response.status_code in (302, 401, 403, 404, 405), url
    # While staff can open them (so the refusal above is about who asks).
    for url in ("/admin/jobs/batch/", "/admin/rq/"):
        assert admin_client.get(url).status_code == 200, url


def test_csrf_is_enforced_on_every_form(people: dict, tmp_path: Path) -> None:
    alice = people["alice"]
    mine = run_batch(make_batch(alice, [chat_line("a", "x"), chat_line("b", "y")], tmp_path),
                     fails=lambda c: c == "a")
    running = make_batch(alice, [chat_line("c", "x")], tmp_path)
    key = ApiKey.objects.filter(owner=alice).first()
    client = Client(enforce_csrf_checks=True)
    client.force_login(alice)
    posts = [
        (reverse("batch_new"), {"file_id": mine.input_file_id, "action": "submit",
                                "completion_window": "24h", "priority": "default"}),
        (reverse("batch_cancel", args=[running.pk]), {}),
        (reverse("batch_rerun", args=[mine.pk]), {}),
        (reverse("batch_spot_check", args=[mine.pk]), {"custom_id": "b", "verdict": "bad"}),
        (reverse("file_delete", args=[mine.input_file_id]), {}),
        (reverse("key_list"), {"name": "sneaky"}),
        (reverse("key_revoke", args=[key.pk]), {}),
        (reverse("logout"), {}),
        ("/admin/logout/", {}),
    ]
    before = (db_snapshot(), storage_snapshot(people["storage"]))
    for url, data in posts:
        response = client.post(url, data)
        assert response.status_code == 403, (url, response.status_code)
        # A token from another session does not help either.
        response = client.post(url, data, HTTP_X_CSRFTOKEN="x" * 32)
        assert response.status_code == 403, url
    assert (db_snapshot(), storage_snapshot(people["storage"])) == before
    login = Client(enforce_csrf_checks=True)
    assert login.post(reverse("login"), {"username": "alice", "password": "pw"}
                      ).status_code == 403
    assert client.get(reverse("batch_list")).status_code == 200  # still signed in


# --- hostile content ---


def test_hostile_content_is_escaped_everywhere(people: dict, tmp_path: Path,
                                               admin_client: Any) -> None:
    alice = people["alice"]
    evil_lines = [chat_line(EVIL + "-id", EVIL + " prompt", max_tokens=50),
                  chat_line("plain", "fine")]
    batch = make_batch(alice, evil_lines, tmp_path, metadata={EVIL[:60]: EVIL})
    File.objects.filter(pk=batch.input_file_id).update(filename=EVIL + ".jsonl")
    batch = run_batch(batch, fails=lambda c: c == "plain",
                      answer=lambda c: f"{EVIL} answer <img src=x onerror=alert(1)>")
    failed = make_batch(alice, [chat_line("v", "x", model=EVIL)], tmp_path)
    assert Batch.objects.get(pk=failed.pk).status == "failed"  # errors.data quotes the model
    create_api_key(owner=alice, name=EVIL)
    client = Client()
    client.force_login(alice)
    pages = [reverse("batch_list"), reverse("file_list"), reverse("key_list"),
             reverse("batch_new") + f"?file_id={batch.input_file_id}"]
    for b in (batch, failed):
        pages += [reverse(name, args=[b.pk]) for name in (
            "batch_detail", "batch_live", "batch_row", "batch_errors", "batch_results",
            "batch_spot_check", "batch_cancel")]
    pages += [reverse("batch_results", args=[batch.pk]) + "?q=%3Cscript%3E",
              reverse("batch_errors", args=[batch.pk]) + "?q=%3Cscript%3E&code=%3Cb%3E"]
    escaped_somewhere = False
    for url in pages:
        response = client.get(url)
        assert response.status_code in (200, 286), url  # 286: htmx, stop polling
        page = response.content.decode()
        assert "<script>alert" not in page and "<img src=x" not in page, url
        escaped_somewhere |= "&lt;script&gt;alert" in page
    assert escaped_somewhere
    for url in (f"/admin/jobs/batch/{quote(batch.pk)}/change/",
                f"/admin/jobs/batch/{quote(failed.pk)}/change/",
                "/admin/jobs/file/", "/admin/jobs/apikey/", "/admin/jobs/batch/"):
        page = admin_client.get(url).content.decode()
        assert "<script>alert" not in page, url
    # The API answers JSON, never HTML, with sniffing off.
    response = Api(people["alice_key"]).get(f"/v1/batches/{failed.pk}")
    assert response["Content-Type"] == "application/json"
    assert response["X-Content-Type-Options"] == "nosniff"
    assert EVIL.replace("/", "\\/") in response.content.decode() or \
        "<script>" in response.json()["errors"]["data"][0]["message"]


def test_downloads_are_attachments_with_safe_names(people: dict, tmp_path: Path) -> None:
    alice = people["alice"]
    batch = run_batch(make_batch(alice, [chat_line("a", "x"), chat_line("b", "y")], tmp_path),
                      fails=lambda c: c == "b")
    running = make_batch(alice, [chat_line("c", "x")], tmp_path)
    hostile = 'a"b\r\nX-Evil: 1;\x07<script>.jsonl'
    File.objects.filter(pk=batch.input_file_id).update(filename=hostile)
    client = Client()
    client.force_login(alice)
    api = Api(people["alice_key"])
    responses = [api.get(f"/v1/files/{fid}/content") for fid in
                 (batch.input_file_id, batch.output_file_id, batch.error_file_id)]
    responses += [client.get(reverse("file_download", args=[batch.input_file_id]))]
    responses += [client.get(reverse("batch_download", args=[b.pk, kind]))
                  for b in (batch, running) for kind in ("input", "output", "errors")]
    for response in responses:
        assert response.status_code == 200
        disposition = response["Content-Disposition"]
        assert disposition.startswith("attachment;"), disposition
        assert "\r" not in disposition and "\n" not in disposition
        assert not response.has_header("X-Evil")
        assert not response["Content-Type"].startswith("text/html")


def test_stored_files_live_outside_every_served_path(people: dict) -> None:
    storage = Path(django_settings.STORAGE_DIR).resolve()
    served = [Path(django_settings.STATIC_ROOT).resolve(),
              *[Path(p).resolve() for p in django_settings.STATICFILES_DIRS]]
    for root in served:
        assert not storage.is_relative_to(root) and not root.is_relative_to(storage)
    file = File.objects.get(pk=people["done"].input_file_id)
    assert re.fullmatch(r"files/[0-9a-f]{32}(_\w+)?", file.storage_name), file.storage_name
    client = Client()
    client.force_login(people["bob"])
    for url in (f"/{file.storage_name}", f"/static/{file.storage_name}",
                f"/media/{file.storage_name}", f"/static/../{file.storage_name}",
                f"/static/../../var/{storage.name}/{file.storage_name}"):
        assert client.get(url).status_code == 404, url


# --- uploads limited before buffering ---


def _post_headers_only(url: str, path: str, headers: dict[str, str], length: int) -> bytes:
    """Send a request that announces `length` bytes but sends only 1 kB of them; return
    what the server answers (within 10 s: it must not wait for the rest)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: {length}\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
        sock.sendall(head.encode() + b"--b\r\nContent-Disposition: form-data; name=\"file\"; "
                     b"filename=\"x.jsonl\"\r\n\r\n" + b"x" * 1024)
        started = time.monotonic()
        answer = b""
        while b"\r\n\r\n" not in answer and time.monotonic() - started < 10:
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
        return answer


@pytest.mark.django_db(transaction=True)
def test_oversized_uploads_are_refused_before_the_body_is_read(live_server: Any,
                                                               settings: Any, tmp_path: Path,
                                                               django_user_model: Any) -> None:
    use_private_storage(settings, tmp_path)
    user = django_user_model.objects.create_user("alice", password="pw")
    key = create_api_key(owner=user, name="k")[1]
    upload_id = Api(key).post_json("/v1/uploads", {
        "filename": "u.jsonl", "purpose": "batch", "bytes": 10**8,
        "mime_type": "application/jsonl"}).json()["id"]
    session = Client()
    session.force_login(user)
    cookie = session.cookies[django_settings.SESSION_COOKIE_NAME].value
    csrf = "a" * 32
    multipart = {"Content-Type": "multipart/form-data; boundary=b"}
    auth = {"Authorization": f"Bearer {key}", **multipart}
    huge = 50 * 1024**3
    cases = [
        ("/v1/files", auth, huge), (f"/v1/uploads/{upload_id}/parts", auth, huge),
        # Just over each view's own limit (below the global one).
        ("/v1/files", auth, settings.BATCHWEB["MAX_FILE_BYTES"] + 128 * 1024),
        (f"/v1/uploads/{upload_id}/parts", auth,
         settings.BATCHWEB["MAX_UPLOAD_PART_BYTES"] + 128 * 1024),
        # The dashboard's upload form, with a valid session and CSRF token.
        ("/batches/new", {**multipart, "Cookie": f"sessionid={cookie}; csrftoken={csrf}",
                          "X-CSRFToken": csrf, "Origin": live_server.url}, huge),
    ]
    for path, headers, length in cases:
        started = time.monotonic()
        answer = _post_headers_only(live_server.url, path, headers, length)
        assert answer.startswith(b"HTTP/1.1 413"), (path, answer[:200])
        assert time.monotonic() - started < 10
    assert File.objects.count() == 0
    assert list(Path(settings.TMP_DIR).iterdir()) == []


# --- RQ jobs carry ids only ---


@pytest.mark.django_db(transaction=True)
def test_rq_jobs_carry_ids_only(settings: Any, tmp_path: Path, django_user_model: Any) -> None:
    from rq.job import Job

    from jobs.lib import queues
    from jobs.tasks import validate_batch

    settings.BATCHWEB = {**settings.BATCHWEB, "SHARD_SIZE": 2}
    use_private_storage(settings, tmp_path)
    user = django_user_model.objects.create_user("alice", password="pw")
    api = Api(create_api_key(owner=user, name="k")[1])
    marker = "MARKER-7f3a"
    lines = [chat_line(f"{marker}-id-{i}", f"{marker} prompt {i}") for i in range(6)]
    file_id = api.upload(jsonl(lines), filename=f"{marker}.jsonl").json()["id"]
    batch_id = api.post_json("/v1/batches", {"input_file_id": file_id,
                                             "endpoint": "/v1/chat/completions",
                                             "completion_window": "24h",
                                             "metadata": {"m": marker}}).json()["id"]
    validate_batch(batch_id)
    assert Shard.objects.filter(batch_id=batch_id, enqueued_at__isnull=False).count() == 2
    redis = queues.connection()
    job_ids = [k.decode().removeprefix("rq:job:") for k in redis.keys("rq:job:*")]
    assert len(job_ids) >= 3  # validation + two shards
    id_pattern = re.compile(r"(batch_|shard_)[0-9a-f]{24}")
    for job_id in job_ids:
        job = Job.fetch(job_id, connection=redis)
        assert job.func_name.startswith("jobs.tasks."), job.func_name
        assert job.kwargs == {}
        assert all(isinstance(a, str) and id_pattern.fullmatch(a) for a in job.args), job.args
    # No value anywhere in Redis carries the user's data.
    for key in redis.keys("*"):
        dumped = redis.dump(key) or b""
        assert marker.encode() not in dumped, key


def test_nothing_unpickles_or_evals_user_input() -> None:
    risky = re.compile(r"\bpickle\b|\bmarshal\b|yaml\.load\(|\beval\(|\bexec\(|shelve")
    for package in ("jobs", "engine", "batchweb"):
        for path in (ROOT / package).rglob("*.py"):
            if "migrations" in path.parts:
                continue
            assert not risky.search(path.read_text()), path


# --- deployment settings and headers ---

# Exactly the production environment of docs/operations.md ("Running on real infrastructure").
PRODUCTION_ENV = {
    "DEBUG": "0", "SECRET_KEY": "k" * 20 + "-Zq8#x!v2@P9$w7&L0^e%R4*t6(Y1)u3-" + "m" * 20,
    "ALLOWED_HOSTS": "batch.example.com",
}


def _production_env() -> dict[str, str]:
    # Without what tests/settings.py adds for the test processes (the plain-HTTP opt-out).
    inherited = {k: v for k, v in os.environ.items()
                 if k not in ("DJANGO_SETTINGS_MODULE", "BATCHWEB_HTTPS")}
    return {**inherited, "DJANGO_SETTINGS_MODULE": "batchweb.settings", **PRODUCTION_ENV}


def _production(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=_production_env(),
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_check_deploy_reports_nothing_with_production_settings() -> None:
    result = subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "DEBUG"],
        env=_production_env(), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "System check identified no issues (0 silenced)." in result.stdout


def test_security_headers_in_production() -> None:
    result = _production("""
import json, django
django.setup()
from django.test import Client
c = Client(HTTP_HOST="batch.example.com")
page = c.get("/accounts/login/", secure=True)
plain = c.get("/accounts/login/")
api = c.get("/v1/models", secure=True)
print(json.dumps({"page": dict(page.headers), "status": page.status_code,
                  "plain": [plain.status_code, plain.headers.get("Location")],
                  "api": dict(api.headers),
                  "cookies": {k: dict(v) for k, v in page.cookies.items()}}))
""")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["status"] == 200
    assert out["plain"] == [301, "https://batch.example.com/accounts/login/"]
    for headers in (out["page"], out["api"]):
        assert headers["Strict-Transport-Security"].startswith("max-age=31536000")
        assert headers["X-Content-Type-Options"] == "nosniff"
        assert headers["X-Frame-Options"] == "DENY"
        assert headers["Referrer-Policy"] == "same-origin"
        assert headers["Cross-Origin-Opener-Policy"] == "same-origin"
    csrf = out["cookies"]["csrftoken"]
    assert csrf["secure"] is True and csrf["samesite"] == "Lax"


def test_security_headers_on_every_kind_of_response(people: dict) -> None:
    client = Client()
    client.force_login(people["bob"])
    responses = [client.get(reverse("batch_list")), Client().get(reverse("login")),
                 Api(people["bob_key"]).get("/v1/batches"), Api("nope").get("/v1/batches"),
                 client.get(reverse("batch_download", args=[people["done"].pk, "output"]))]
    for response in responses:
        assert response["X-Content-Type-Options"] == "nosniff"
        assert response["X-Frame-Options"] == "DENY"
        assert response["Referrer-Policy"] == "same-origin"
    login = Client().get(reverse("login"))
    session = Client()
    session.post(reverse("login"), {"username": "bob", "password": "pw"})
    assert session.cookies[django_settings.SESSION_COOKIE_NAME]["httponly"]
    assert "csrfmiddlewaretoken" in login.content.decode()
