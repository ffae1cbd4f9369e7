"""The quick tier (`make quick`, tests/conftest.py): a test is in it by what it uses, and one
in it that starts a process or reaches a server fails, naming the marker to add. Planted
tests, run by a pytest of their own with the suite's hooks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.factories import ROOT

PLANTED = '''
import socket
import subprocess

import pytest


def test_pure():
    assert sum([1, 2]) == 3


def test_starts_a_process():
    subprocess.run(["true"], check=True)


def test_connects():
    socket.create_connection(("127.0.0.1", 9), timeout=1)


@pytest.mark.processes
def test_says_it_starts_one():
    subprocess.run(["true"], check=True)


@pytest.mark.redis
def test_says_it_talks_to_redis():
    pass


def test_uses_the_database(db):
    pass
'''

# The suite's hooks and the fixture they read, for the planted tests' folder.
CONFTEST = """
from tests.conftest import (
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_runtest_protocol,
    starts_processes,
)
"""

# It runs pytest as a process.
pytestmark = pytest.mark.processes


def test_the_tier_is_what_tests_use_and_a_test_reaching_out_fails(tmp_path: Path):
    planted = tmp_path / "test_planted.py"
    planted.write_text(PLANTED)
    (tmp_path / "conftest.py").write_text(CONFTEST)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "--rootdir",
         str(ROOT), "-p", "no:cacheprovider", "-m", "quick", "-rA", str(planted)],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    out = run.stdout + run.stderr
    assert "3 deselected" in out, out
    # "-rA": a line per test, "PASSED path::name" or "FAILED path::name - why".
    results = {line.split("::")[1].split(" ")[0]: line.split(" ")[0]
               for line in out.splitlines() if line.startswith(("PASSED", "FAILED"))}
    assert results == {"test_pure": "PASSED", "test_starts_a_process": "FAILED",
                       "test_connects": "FAILED"}, out
    assert "is in the quick tier but starts a process" in out
    assert "is in the quick tier but connects to a server" in out
    assert "mark it `processes`" in out
