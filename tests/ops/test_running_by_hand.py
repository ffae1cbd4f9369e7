"""Running the service by hand, as docs/operations.md ("Running it by hand") describes it:
`manage.py help` in a fresh checkout, runservice's options, and the Redis each process
started by hand says it uses."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobs.storage.embedded import redis_in_use
from tests.factories import ROOT

# What a fresh clone has of the checkout (no var/: no secret_key, database or models).
CHECKOUT = ("manage.py", "pyproject.toml", "batchweb", "jobs", "engine", "templates",
            "static")
OUR_COMMANDS = ("batchworker", "cleanup", "controlworker", "createapikey", "demouser",
                "gpuworkers", "preparemodels", "runservice")


def fresh_checkout(tmp_path: Path) -> Path:
    clone = tmp_path / "clone"
    clone.mkdir()
    for name in CHECKOUT:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, clone / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(source, clone / name)
    return clone


def manage(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("SECRET_KEY", "DEBUG", "DJANGO_SETTINGS_MODULE")}
    return subprocess.run([sys.executable, "manage.py", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.processes
def test_manage_help_lists_the_commands_in_a_fresh_checkout(tmp_path: Path) -> None:
    """Without a key (no SECRET_KEY, no var/secret_key) the settings refuse to load; help
    still lists batchweb's own commands beside Django's, and says what the key is for."""
    clone = fresh_checkout(tmp_path)
    assert not (clone / "var" / "secret_key").exists()
    done = manage(clone, "help")
    assert done.returncode == 0, done.stderr
    listed = done.stdout.split("[jobs]", 1)
    assert len(listed) == 2, done.stdout + done.stderr
    assert all(f"    {name}\n" in listed[1] for name in OUR_COMMANDS), listed[1]
    assert "migrate" in listed[0]  # Django's own too
    assert "make install" in done.stderr and "SECRET_KEY" in done.stderr
    # A command's own help too.
    runservice = manage(clone, "runservice", "--help")
    assert runservice.returncode == 0, runservice.stderr
    assert "--bind HOST:PORT" in runservice.stdout
    # Anything but help still refuses to start without a key.
    refused = manage(clone, "check")
    assert refused.returncode != 0 and "SECRET_KEY" in refused.stderr
    assert not (clone / "var" / "secret_key").exists()


@pytest.mark.processes
def test_runservice_says_what_bind_and_its_other_options_do() -> None:
    done = subprocess.run([sys.executable, "manage.py", "runservice", "--help"], cwd=ROOT,
                          capture_output=True, text=True, check=True, timeout=120)
    text = " ".join(done.stdout.split())
    assert "--bind HOST:PORT Where the web server and the API listen (default BATCHWEB_BIND, " \
           "else 127.0.0.1:8000)" in text, text
    assert "BATCHWEB_RUN_MODELS" in text and "Web server processes" in text


def test_the_redis_a_process_uses_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REDIS_URL", raising=False)
    assert redis_in_use("redis://127.0.0.1:6379/0") == (
        "redis://127.0.0.1:6379/0 (REDIS_URL is unset: the default, not the private Redis "
        "of `make run`)")
    monkeypatch.setenv("REDIS_URL", "rediss://:s3cret@redis.internal:6380/2")
    named = redis_in_use("rediss://:s3cret@redis.internal:6380/2")
    assert named == "rediss://:***@redis.internal:6380/2 (REDIS_URL)"
    assert redis_in_use("redis://app:pw@redis:6379/0").startswith("redis://app:***@redis:6379/0")


@pytest.mark.django_db(transaction=True)
def test_a_worker_started_by_hand_names_its_redis(workers, settings) -> None:
    """The line a worker started by hand prints first: which Redis it takes jobs from."""
    proc = workers.start_control()
    deadline = time.monotonic() + 60
    while "Redis" not in workers.logs():
        assert proc.poll() is None and time.monotonic() < deadline, workers.logs()
        time.sleep(0.2)
    line = next(line for line in workers.logs().splitlines() if ": Redis " in line)
    assert line.startswith("controlworker ")
    assert line.endswith(f": Redis {settings.REDIS_URL} (REDIS_URL)"), line
