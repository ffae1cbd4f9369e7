"""Uploads and the storage quota: a pending upload reserves its declared size, a user may
keep only BATCHWEB_MAX_OPEN_UPLOADS pending, and parts sent in parallel never add up to
more than the upload's declared size."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.core.files.storage import default_storage
from django.utils import timezone

from jobs.lib.errors import ServiceError
from jobs.models import File, Quota, Upload, UploadPart
from jobs.services import quotas
from jobs.services import uploads as upload_service
from tests.factories import Api, assert_openai_error, chat_line, in_thread, jsonl, make_file

CONTENT = jsonl([chat_line(f"r{i}", f"hello {i}") for i in range(3)])


def new_upload(owner: Any, size: int) -> Upload:
    return upload_service.create_upload(owner=owner, filename="big.jsonl", purpose="batch",
                                        bytes=size, mime_type="application/jsonl")


def add_part(upload: Upload, data: bytes, tmp_path: Path) -> UploadPart:
    path = tmp_path / f"part-{time.monotonic_ns()}-{threading.get_ident()}"
    path.write_bytes(data)
    return upload_service.add_upload_part(upload=upload, path=path)


@pytest.mark.django_db
def test_pending_uploads_count_against_stored_bytes(user, tmp_path):
    Quota.objects.update_or_create(user=user, defaults={"max_stored_bytes": len(CONTENT)})
    reserved = new_upload(user, len(CONTENT) - 10)
    assert quotas.usage_for(user)["max_stored_bytes"] == len(CONTENT) - 10
    # The reservation leaves 10 bytes: neither a second upload nor a file may take more.
    with pytest.raises(ServiceError) as caught:
        new_upload(user, 11)
    assert (caught.value.status, caught.value.code) == (429, "max_stored_bytes_exceeded")
    assert f"you store {len(CONTENT) - 10:,} of {len(CONTENT):,} bytes" in \
        caught.value.message
    with pytest.raises(ServiceError, match="stored bytes"):
        make_file(user, [chat_line("a", "x" * 20)], tmp_path)
    assert Upload.objects.filter(owner=user).count() == 1

    # Cancelling gives the room back; an upload of the whole quota may then be completed
    # (its reservation becomes the file, it is not counted twice).
    upload_service.cancel_upload(upload=reserved)
    assert quotas.usage_for(user)["max_stored_bytes"] == 0
    whole = new_upload(user, len(CONTENT))
    first = add_part(whole, CONTENT[:7], tmp_path)
    rest = add_part(whole, CONTENT[7:], tmp_path)
    done = upload_service.complete_upload(upload=whole, part_ids=[first.pk, rest.pk])
    assert done.status == "completed" and done.file.bytes == len(CONTENT)
    assert quotas.usage_for(user)["max_stored_bytes"] == len(CONTENT)


@pytest.mark.django_db
def test_parts_of_an_expired_upload_count_until_cleanup(user, tmp_path):
    Quota.objects.update_or_create(user=user, defaults={"max_stored_bytes": 100})
    upload = new_upload(user, 60)
    add_part(upload, b"x" * 25, tmp_path)
    assert quotas.usage_for(user)["max_stored_bytes"] == 60
    Upload.objects.filter(pk=upload.pk).update(expires_at=timezone.now() - timedelta(1))
    # No longer open: what counts is what its parts still take in storage.
    assert quotas.usage_for(user)["max_stored_bytes"] == 25
    new_upload(user, 75)
    with pytest.raises(ServiceError, match="stored bytes"):
        new_upload(user, 1)


@pytest.mark.django_db
def test_open_uploads_are_capped(user, api_key, settings):
    settings.BATCHWEB = {**settings.BATCHWEB, "MAX_OPEN_UPLOADS": 2}
    api = Api(api_key)
    body = {"filename": "big.jsonl", "purpose": "batch", "bytes": 100,
            "mime_type": "application/jsonl"}
    first = api.post_json("/v1/uploads", body).json()
    assert api.post_json("/v1/uploads", body).status_code == 200
    error = assert_openai_error(api.post_json("/v1/uploads", body), 429,
                                code="max_open_uploads_exceeded",
                                fragment="2 uploads pending and at most 2 may be")
    assert error["type"] == "insufficient_quota"
    assert error["message"].startswith("Quota exceeded (open uploads): ")
    assert Upload.objects.filter(owner=user).count() == 2

    # Closing one (cancelled, or expired) frees a place.
    assert api.post_json(f"/v1/uploads/{first['id']}/cancel", {}).status_code == 200
    second_wave = api.post_json("/v1/uploads", body).json()
    assert_openai_error(api.post_json("/v1/uploads", body), 429,
                        code="max_open_uploads_exceeded")
    Upload.objects.filter(pk=second_wave["id"]).update(
        expires_at=timezone.now() - timedelta(seconds=1))
    assert api.post_json("/v1/uploads", body).status_code == 200


@pytest.mark.django_db
def test_the_default_cap_on_open_uploads(user, settings):
    assert settings.BATCHWEB["MAX_OPEN_UPLOADS"] == 10
    for _ in range(10):
        new_upload(user, 10)
    with pytest.raises(ServiceError, match="at most 10 may be"):
        new_upload(user, 10)


class SlowStorage:
    """The default storage, slow to save: parts sent together are all in flight while
    each is checked against the declared size."""

    def __getattr__(self, name: str) -> Any:
        return getattr(default_storage, name)

    def save(self, name: str, content: Any) -> str:
        time.sleep(0.3)
        return default_storage.save(name, content)


@pytest.mark.django_db(transaction=True)
def test_parallel_parts_cannot_exceed_the_declared_size(user, tmp_path, monkeypatch):
    """Runs on PostgreSQL when DATABASE_URL points to it (CI), where the row lock does the
    work; on SQLite writers are serialized by the transaction itself."""
    monkeypatch.setattr(upload_service, "default_storage", SlowStorage())
    upload = new_upload(user, 10)
    senders = 6
    start = threading.Barrier(senders)
    added: list[UploadPart] = []
    refused: list[ServiceError] = []
    unexpected: list[BaseException] = []

    def send() -> None:
        try:
            start.wait()
            added.append(add_part(Upload.objects.get(pk=upload.pk), b"12345", tmp_path))
        except ServiceError as exc:
            refused.append(exc)
        except BaseException as exc:  # noqa: BLE001 (shown by the assertion below)
            unexpected.append(exc)

    threads = [in_thread(send) for _ in range(senders)]
    for thread in threads:
        thread.join(timeout=60)
    assert not unexpected, unexpected
    assert len(added) == 2 and len(refused) == senders - 2
    assert all("exceed the upload's 10 bytes" in exc.message for exc in refused)
    assert sum(p.bytes for p in UploadPart.objects.filter(upload=upload)) == 10
    # What the refused parts had stored is gone again.
    assert sorted(default_storage.listdir(f"uploads/{upload.pk}")[1]) == sorted(
        p.storage_name.rsplit("/", 1)[1] for p in added)
    assert not File.objects.filter(owner=user).exists()
