"""Shared by the reliability and security tests: a storage of the test's own, snapshots of
the database and the storage ("nothing stored changes"), and API calls through Django's
test client with a Bearer key."""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path
from typing import Any

from django.apps import apps
from django.core.files.storage import default_storage
from django.test import Client

# Fields that legitimately change on a refused request (a key's "last used" stamp).
VOLATILE_FIELDS = {"last_used_at"}


def use_private_storage(settings: Any, root: Path) -> Path:
    """Point Django's default storage (and the scratch directory) at `root`, so a test can
    see every object it creates and nothing another test (or person) creates."""
    storage = root / "storage"
    tmp = root / "tmp"
    storage.mkdir(parents=True, exist_ok=True)
    tmp.mkdir(parents=True, exist_ok=True)
    settings.STORAGES = {**settings.STORAGES, "default": {
        "BACKEND": "django.core.files.storage.FileSystemStorage",
        "OPTIONS": {"location": str(storage)}}}
    settings.TMP_DIR = tmp
    settings.FILE_UPLOAD_TEMP_DIR = str(tmp)
    assert Path(default_storage.location) == storage  # type: ignore[attr-defined]
    return storage


def storage_snapshot(root: Path) -> dict[str, str]:
    """Every object under a storage root with its content digest."""
    found = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = Path(dirpath) / name
            found[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def db_snapshot() -> dict[str, list[str]]:
    """Every row of the service's tables (and the users), as comparable text."""
    snapshot: dict[str, list[str]] = {}
    models = [*apps.get_app_config("jobs").get_models(), apps.get_model("auth", "User")]
    for model in models:
        rows = []
        for row in model.objects.values():
            rows.append(json.dumps({k: v for k, v in row.items() if k not in VOLATILE_FIELDS},
                                   sort_keys=True, default=str))
        snapshot[model.__name__] = sorted(rows)
    return snapshot


class Api:
    """The /v1 API through Django's test client (in-process: fast, and an unhandled
    exception would surface as a 500 the tests count)."""

    def __init__(self, key: str) -> None:
        self.client = Client()
        self.headers = {"HTTP_AUTHORIZATION": f"Bearer {key}"}

    def get(self, path: str, **extra: Any) -> Any:
        return self.client.get(path, **{**self.headers, **extra})

    def delete(self, path: str) -> Any:
        return self.client.delete(path, **self.headers)

    def post_json(self, path: str, body: Any, **extra: Any) -> Any:
        data = body if isinstance(body, str | bytes) else json.dumps(body)
        return self.client.post(path, data=data, content_type="application/json",
                                **{**self.headers, **extra})

    def post_raw(self, path: str, data: bytes | str, content_type: str) -> Any:
        return self.client.post(path, data=data, content_type=content_type, **self.headers)

    def post_multipart(self, path: str, data: dict[str, Any]) -> Any:
        return self.client.post(path, data=data, **self.headers)

    def upload(self, content: bytes, *, filename: str = "in.jsonl", purpose: Any = "batch",
               **fields: Any) -> Any:
        # A plain stream rather than SimpleUploadedFile, which refuses names such as "/"
        # on the client side: any name must reach the server (the test client sends the
        # name's last path component, as browsers do).
        file = io.BytesIO(content)
        file.name = filename  # type: ignore[attr-defined]
        file.content_type = "application/jsonl"  # type: ignore[attr-defined]
        data: dict[str, Any] = {"file": file}
        if purpose is not None:
            data["purpose"] = purpose
        data.update(fields)
        return self.post_multipart("/v1/files", data)


def assert_openai_error(response: Any, status: int, *, code: str | None = None,
                        param: str | None = None, fragment: str | None = None) -> dict:
    """The response is the documented OpenAI error object with this status (and code,
    param, message fragment when given)."""
    assert response.status_code == status, (response.status_code, response.content[:500])
    assert response["Content-Type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    if fragment is not None:
        assert fragment in error["message"], error
    return error


def assert_exactly_once(output_lines: list[dict], error_lines: list[dict],
                        expected: set[str]) -> None:
    """Every expected custom_id appears exactly once across a batch's output and error
    files, and nothing else does."""
    ids = [r["custom_id"] for r in output_lines + error_lines]
    assert len(ids) == len(set(ids)), "a custom_id appears twice"
    assert set(ids) == expected
