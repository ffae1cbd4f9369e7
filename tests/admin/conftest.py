"""The admin's fixtures: a staff client and a running batch to act on."""

from __future__ import annotations

import pytest

from jobs.models import Batch
from jobs.services.batches import create_batch
from jobs.services.files import create_input_file
from jobs.services.validation import run_validation
from tests.factories import chat_line, jsonl


@pytest.fixture
def staff(admin_client):
    return admin_client


@pytest.fixture
def running_batch(user, tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl([chat_line(f"r{i}", "x") for i in range(3)]))
    file = create_input_file(owner=user, path=path, filename="in.jsonl", purpose="batch")
    batch = create_batch(owner=user, input_file_id=file.pk, endpoint="/v1/chat/completions",
                         completion_window="24h")
    run_validation(batch_id=batch.pk)
    return Batch.objects.get(pk=batch.pk)
