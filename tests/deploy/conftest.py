"""The deployment test (test_stack.py, marked `deploy`) runs only with BATCHWEB_DEPLOY=1
(`make deploy-test`, as root): it installs and starts Docker, builds images and runs the
whole compose stack for minutes. Everywhere else it is reported skipped."""

from __future__ import annotations

import os
from typing import Any

import pytest


def pytest_configure(config: Any) -> None:
    config.addinivalue_line(
        "markers", "deploy: the compose stack built and run in Docker; `make deploy-test`")


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    if os.environ.get("BATCHWEB_DEPLOY") == "1":
        return
    skip = pytest.mark.skip(reason="deployment test: run with `make deploy-test` "
                                   "(BATCHWEB_DEPLOY=1, root)")
    for item in items:
        if item.get_closest_marker("deploy"):
            item.add_marker(skip)
