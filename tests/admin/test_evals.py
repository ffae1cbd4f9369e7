"""Eval sets in the admin: an operator uploads a set's JSONL (checked line by line: a bad
line is shown with its number and nothing is stored), edits its threshold and watched
models, and accepts a run as a baseline."""

from __future__ import annotations

import json

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from jobs.models import EvalSet

pytestmark = pytest.mark.django_db


def _items(expected: object = "echo: hi") -> bytes:
    return b"".join(json.dumps({
        "custom_id": f"q{i}", "body": {"messages": [{"role": "user", "content": "hi"}]},
        "expected": expected}).encode() + b"\n" for i in range(3))


def _form(name: str, content: bytes) -> dict:
    return {"name": name, "rule": "exact", "tolerance": "0", "embedding_model": "",
            "similarity": "0.9", "drift_threshold": "0.1", "watch_models": '["echo-test"]',
            "upload": SimpleUploadedFile("set.jsonl", content)}


def test_an_operator_uploads_a_set(staff, settings, tmp_path):
    settings.STORAGES = {**settings.STORAGES, "default": {
        "BACKEND": "django.core.files.storage.FileSystemStorage",
        "OPTIONS": {"location": str(tmp_path)}}}
    refused = staff.post("/admin/jobs/evalset/add/", _form("bad", _items(expected=3)))
    assert refused.status_code == 200
    assert "Line 1: expected must be a string." in refused.content.decode()
    assert not EvalSet.objects.exists() and not list(tmp_path.rglob("*"))

    added = staff.post("/admin/jobs/evalset/add/", _form("smoke", _items()))
    assert added.status_code == 302, added.context["adminform"].form.errors
    created = EvalSet.objects.get()
    assert (created.name, created.item_count, created.watch_models) == ("smoke", 3,
                                                                         ["echo-test"])
    assert staff.get(f"/admin/jobs/evalset/{created.pk}/change/").status_code == 200
    assert staff.get("/admin/jobs/evalrun/").status_code == 200
