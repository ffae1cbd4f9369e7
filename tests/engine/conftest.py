"""Engine tests need neither Django nor Redis.

`_clean_redis` overrides the autouse fixture of tests/conftest.py (same name) so these tests
run without a Redis server; the engine package never touches it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

# Shared with the Django side and `python -m engine.prepare` (gitignored).
MODEL_CACHE = Path(__file__).resolve().parents[2] / "var" / "models"


@pytest.fixture(autouse=True)
def _clean_redis() -> Iterator[None]:
    yield


@pytest.fixture(scope="session")
def model_cache() -> Path:
    return MODEL_CACHE
