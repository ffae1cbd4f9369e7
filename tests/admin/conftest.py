"""The admin's fixtures: a staff client and a running batch to act on."""

from __future__ import annotations

import pytest

from tests.factories import chat_line, make_batch


@pytest.fixture
def staff(admin_client):
    return admin_client


@pytest.fixture
def running_batch(user, tmp_path):
    return make_batch(user, [chat_line(f"r{i}", "x") for i in range(3)], tmp_path)
