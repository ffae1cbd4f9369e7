"""The malformed-input corpus (tests/bad_inputs) against the API: every case gets its
documented error (never a 5xx), and the database and the storage are left unchanged."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from jobs.models import Batch, File, RequestCopy, ScreenedLine, Shard, Upload
from jobs.services.keys import create_api_key
from jobs.tasks import validate_batch
from tests.factories import (
    Api,
    assert_openai_error,
    db_snapshot,
    storage_snapshot,
    use_private_storage,
)
from tests.security.bad_inputs import (
    ALL_CASES,
    API_CASES,
    FILE_CASES,
    GOOD,
    LENIENT_CASES,
    LINE_CASES,
    LINE_LIMITS,
    UPLOAD_FLOW_CASES,
    ApiCase,
    FileCase,
    LenientCase,
    LineCase,
)

pytestmark = pytest.mark.django_db


class World:
    def __init__(self, storage: Path, tmp: Path, api: Api, other: Api, file_id: str,
                 other_file_id: str, other_batch_id: str) -> None:
        self.storage = storage
        self.tmp = tmp
        self.api = api
        self.other = other
        self.file_id = file_id
        self.other_file_id = other_file_id
        self.other_batch_id = other_batch_id

    def snapshot(self) -> tuple[dict, dict]:
        return db_snapshot(), storage_snapshot(self.storage)

    def assert_unchanged(self, before: tuple[dict, dict]) -> None:
        db, storage = self.snapshot()
        assert storage == before[1], "storage changed"
        for table, rows in before[0].items():
            assert db[table] == rows, f"table {table} changed"
        # Scratch files (Django's upload temp files, assembled uploads) are gone too.
        assert list(self.tmp.iterdir()) == []

    def fill(self, text: str) -> str:
        return (text.replace("{file}", self.file_id).replace("{other}", self.other_file_id)
                if "/batches?" not in text else
                text.replace("{other}", self.other_batch_id))


@pytest.fixture
def world(settings: Any, tmp_path: Path, django_user_model: Any) -> Iterator[World]:
    user = django_user_model.objects.create_user("alice", password="pw")
    other_user = django_user_model.objects.create_user("bob", password="pw")
    storage = use_private_storage(settings, tmp_path)
    api = Api(create_api_key(owner=user, name="t")[1])
    other = Api(create_api_key(owner=other_user, name="t")[1])
    file_id = api.upload(GOOD).json()["id"]
    other_file_id = other.upload(GOOD).json()["id"]
    other_batch = other.post_json("/v1/batches", {
        "input_file_id": other_file_id, "endpoint": "/v1/chat/completions",
        "completion_window": "24h"}).json()["id"]
    yield World(storage, tmp_path / "tmp", api, other, file_id, other_file_id, other_batch)


def test_the_corpus_has_at_least_50_cases() -> None:
    assert len(ALL_CASES) >= 50, len(ALL_CASES)
    assert len(set(ALL_CASES)) == len(ALL_CASES), "case names must be unique"


@pytest.mark.parametrize("case", FILE_CASES, ids=lambda c: c.name)
def test_bad_file_is_refused_and_nothing_is_stored(world: World, settings: Any,
                                                   case: FileCase) -> None:
    settings.BATCHWEB = {**settings.BATCHWEB, **case.limits}
    before = world.snapshot()
    response = world.api.upload(case.content, filename=case.filename, purpose=case.purpose,
                                **case.fields)
    assert_openai_error(response, case.status, code=case.code, param=case.param,
                        fragment=case.fragment or None)
    world.assert_unchanged(before)


@pytest.mark.parametrize("case", LENIENT_CASES, ids=lambda c: c.name)
def test_irregular_but_documented_files_are_accepted(world: World, case: LenientCase) -> None:
    before = storage_snapshot(world.storage)
    response = world.api.upload(case.content, filename=case.filename)
    assert response.status_code == 200, response.content
    created = response.json()
    row = File.objects.get(pk=created["id"])
    assert row.line_count == case.requests
    assert row.bytes == len(case.content)
    name = created["filename"]
    if case.shown_name is not None:
        assert name == case.shown_name
    assert 0 < len(name) <= 255 and name.isprintable()
    assert "/" not in name and "\\" not in name and ".." not in name.split("/")
    # Stored under a random name, never the user's.
    new = set(storage_snapshot(world.storage)) - set(before)
    assert new == {row.storage_name}
    assert row.storage_name.startswith("files/") and case.filename[-8:] not in row.storage_name
    download = world.api.get(f"/v1/files/{row.pk}/content")
    assert download["Content-Disposition"].startswith("attachment;")
    assert b"".join(download.streaming_content) == case.content

    batch = world.api.post_json("/v1/batches", {"input_file_id": row.pk,
                                                "endpoint": "/v1/chat/completions",
                                                "completion_window": "24h"}).json()
    validate_batch(batch["id"])
    batch = world.api.get(f"/v1/batches/{batch['id']}").json()
    assert batch["status"] == "in_progress", batch["errors"]
    assert batch["request_counts"]["total"] == case.requests


@pytest.mark.parametrize("case", LINE_CASES, ids=lambda c: c.name)
def test_bad_lines_fail_validation_with_every_line_named(world: World, settings: Any,
                                                         case: LineCase) -> None:
    response = world.api.upload(case.content)
    assert response.status_code == 200, response.content
    file_id = response.json()["id"]
    settings.BATCHWEB = {**settings.BATCHWEB, **LINE_LIMITS.get(case.name, {})}
    created = world.api.post_json("/v1/batches", {"input_file_id": file_id,
                                                  "endpoint": case.endpoint,
                                                  "completion_window": "24h",
                                                  "strict": True})
    assert created.status_code == 200, created.content
    storage_before = storage_snapshot(world.storage)
    validate_batch(created.json()["id"])
    batch = world.api.get(f"/v1/batches/{created.json()['id']}").json()
    assert batch["status"] == "failed"
    assert batch["failed_at"] is not None
    data = batch["errors"]["data"]
    assert [(e["line"], e["code"]) for e in data] == case.errors
    for entry in data:
        assert set(entry) == {"code", "line", "message", "param"} and entry["message"]
    assert batch["output_file_id"] is None and batch["error_file_id"] is None
    assert not Shard.objects.filter(batch_id=batch["id"]).exists()
    assert not RequestCopy.objects.filter(batch_id=batch["id"]).exists()
    assert storage_snapshot(world.storage) == storage_before
    # Validating again changes nothing.
    validate_batch(batch["id"])
    assert world.api.get(f"/v1/batches/{batch['id']}").json()["errors"]["data"] == data


@pytest.mark.parametrize("case", LINE_CASES, ids=lambda c: c.name)
def test_bad_lines_not_strict_fail_the_batch_or_only_their_requests(
        world: World, settings: Any, case: LineCase) -> None:
    """Not strict (the default), each case's lines are file problems (the batch fails with
    exactly them, as strict) or request problems: the batch runs, and each of those lines is
    kept from running with the same line and code (its shard writes the endpoint's 400)."""
    file_id = world.api.upload(case.content).json()["id"]
    settings.BATCHWEB = {**settings.BATCHWEB, **LINE_LIMITS.get(case.name, {})}
    created = world.api.post_json("/v1/batches", {"input_file_id": file_id,
                                                  "endpoint": case.endpoint,
                                                  "completion_window": "24h"}).json()
    validate_batch(created["id"])
    batch = world.api.get(f"/v1/batches/{created['id']}").json()
    kept = sorted(ScreenedLine.objects.filter(batch_id=batch["id"]).values_list("line", "code"))
    if batch["status"] == "failed":
        assert [(e["line"], e["code"]) for e in batch["errors"]["data"]] == case.errors
        assert kept == []
    else:
        assert batch["status"] == "in_progress", batch
        assert kept == case.errors
        lines = len([line for line in case.content.splitlines() if line.strip()])
        assert batch["request_counts"]["total"] == lines and batch["errors"] is None


@pytest.mark.parametrize("case", API_CASES, ids=lambda c: c.name)
def test_bad_api_request_is_refused_and_nothing_changes(world: World,
                                                        case: ApiCase) -> None:
    path = world.fill(case.path)
    before = world.snapshot()
    if case.method == "GET":
        response = world.api.get(path)
    elif isinstance(case.body, bytes):
        response = world.api.post_raw(path, case.body, case.content_type)
    else:
        body = json.loads(world.fill(json.dumps(case.body)))
        if case.method == "PUT":
            response = world.api.client.put(path, data=json.dumps(body),
                                            content_type="application/json",
                                            **world.api.headers)
        else:
            response = world.api.post_json(path, body)
    assert_openai_error(response, case.status, code=case.code, param=case.param)
    world.assert_unchanged(before)


# --- the Uploads API ---

FIRST, SECOND = GOOD[:10], GOOD[10:]  # not at a line boundary


def new_upload(api: Api, size: int = len(GOOD)) -> str:
    response = api.post_json("/v1/uploads", {"filename": "big.jsonl", "purpose": "batch",
                                             "bytes": size, "mime_type": "application/jsonl"})
    assert response.status_code == 200, response.content
    return response.json()["id"]


def add_part(api: Api, upload_id: str, data: bytes) -> Any:
    return api.post_multipart(f"/v1/uploads/{upload_id}/parts",
                              {"data": SimpleUploadedFile("blob", data)})


def part(api: Api, upload_id: str, data: bytes) -> str:
    response = add_part(api, upload_id, data)
    assert response.status_code == 200, response.content
    return response.json()["id"]


def complete(api: Api, upload_id: str, part_ids: Any, **extra: Any) -> Any:
    return api.post_json(f"/v1/uploads/{upload_id}/complete", {"part_ids": part_ids, **extra})


def refused(world: World, call: Any, status: int, **expected: Any) -> dict:
    before = world.snapshot()
    error = assert_openai_error(call(), status, **expected)
    world.assert_unchanged(before)
    return error


def test_upload_parts_are_refused(world: World, settings: Any) -> None:
    api = world.api
    upload_id = new_upload(api)
    refused(world, lambda: add_part(api, upload_id, b""), 400, param="data")  # empty part
    settings.BATCHWEB = {**settings.BATCHWEB, "MAX_UPLOAD_PART_BYTES": 10}
    refused(world, lambda: add_part(api, upload_id, b"x" * 11), 413, code="file_too_large")
    settings.BATCHWEB = {**settings.BATCHWEB, "MAX_UPLOAD_PART_BYTES": 1024}
    part(api, upload_id, FIRST)
    refused(world, lambda: add_part(api, upload_id, GOOD), 400, param="data")  # over bytes
    refused(world, lambda: api.post_json(f"/v1/uploads/{upload_id}/parts", {"data": "x"}),
            400, param="data")


def test_upload_completions_are_refused(world: World) -> None:
    api = world.api
    upload_id = new_upload(api)
    first, second = part(api, upload_id, FIRST), part(api, upload_id, SECOND)
    other_upload = new_upload(api)
    foreign = part(api, other_upload, FIRST)
    for part_ids, fragment in [
        ([], "non-empty list"), ("part_x", "non-empty list"), ([first, 3], "non-empty list"),
        ([first, first], "more than once"), ([first, "part_nope"], "Unknown part"),
        ([first, foreign], "Unknown part"), ([first], "hold"),
    ]:
        refused(world, lambda p=part_ids: complete(api, upload_id, p), 400, param="part_ids",
                fragment=fragment)
    refused(world, lambda: complete(api, upload_id, [first, second], md5="0" * 32), 400,
            param="md5")
    refused(world, lambda: complete(api, upload_id, [first, second], md5=123), 400,
            param="md5")
    # Parts in the wrong order: the right size, but not JSONL any more.
    refused(world, lambda: complete(api, upload_id, [second, first]), 400,
            code="invalid_file")
    refused(world, lambda: api.post_raw(f"/v1/uploads/{upload_id}/complete",
                                        f"part_ids={first}",
                                        "application/x-www-form-urlencoded"), 400)
    done = complete(api, upload_id, [first, second], md5=hashlib.md5(GOOD).hexdigest())
    assert done.status_code == 200 and done.json()["status"] == "completed"
    refused(world, lambda: complete(api, upload_id, [first, second]), 409,
            code="invalid_state")
    refused(world, lambda: add_part(api, upload_id, b"x"), 409, code="invalid_state")
    refused(world, lambda: api.post_json(f"/v1/uploads/{upload_id}/cancel", {}), 409)
    assert Upload.objects.get(pk=upload_id).file.bytes == len(GOOD)


def test_cancelled_upload_refuses_everything(world: World) -> None:
    api = world.api
    upload_id = new_upload(api)
    first = part(api, upload_id, FIRST)
    assert api.post_json(f"/v1/uploads/{upload_id}/cancel", {}).status_code == 200
    refused(world, lambda: complete(api, upload_id, [first]), 409)
    refused(world, lambda: api.post_json(f"/v1/uploads/{upload_id}/cancel", {}), 409)
    refused(world, lambda: add_part(api, upload_id, FIRST), 409)
    assert File.objects.filter(owner__username="alice").count() == 1  # only the setup file


def test_upload_flow_cases_are_all_exercised() -> None:
    # The names in the corpus are the behaviours the three tests above check.
    assert len(UPLOAD_FLOW_CASES) == 17


def test_no_refusal_creates_a_batch(world: World) -> None:
    # After the corpus, only the fixture's batch exists: nothing refused left a trace.
    assert Batch.objects.count() == 1
