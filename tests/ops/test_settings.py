"""Settings read from the environment fail loudly on a malformed value."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured

from batchweb.settings import env_bool, env_float, env_int
from tests.factories import ROOT


@pytest.mark.parametrize(("value", "expected"), [
    ("1", True), ("true", True), ("Yes", True), ("on", True),
    ("0", False), ("false", False), ("NO", False), ("off", False), ("", False)])
def test_booleans_read_every_usual_spelling(monkeypatch: pytest.MonkeyPatch, value: str,
                                           expected: bool) -> None:
    monkeypatch.setenv("BATCHWEB_X", value)
    assert env_bool("BATCHWEB_X", not expected) is expected


def test_an_unset_variable_reads_as_its_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BATCHWEB_X", raising=False)
    assert env_bool("BATCHWEB_X", True) is True
    assert env_int("BATCHWEB_X", 7) == 7
    assert env_float("BATCHWEB_X", 0.5) == 0.5


@pytest.mark.parametrize(("reader", "value"), [
    (env_bool, "ture"), (env_bool, "2"), (env_int, "10k"), (env_int, "1.5"),
    (env_float, "fast")])
def test_a_malformed_value_names_the_variable(monkeypatch: pytest.MonkeyPatch, reader: object,
                                              value: str) -> None:
    monkeypatch.setenv("BATCHWEB_X", value)
    with pytest.raises(ImproperlyConfigured, match="BATCHWEB_X"):
        reader("BATCHWEB_X", 0)  # type: ignore[operator]


def _import_settings(**env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "import batchweb.settings"], cwd=ROOT, text=True,
        capture_output=True, env={**os.environ, **env}, timeout=60)


def _message_batch_limits(**env: str) -> list[int]:
    names = ("BATCHWEB_MESSAGE_BATCH_MAX_REQUESTS", "BATCHWEB_MESSAGE_BATCH_MAX_BYTES",
             "BATCHWEB_MAX_REQUESTS_PER_BATCH", "BATCHWEB_MAX_FILE_BYTES")
    result = subprocess.run(
        [sys.executable, "-c", "import json, batchweb.settings as s; b = s.BATCHWEB; print("
         "json.dumps([b[k] for k in ('MESSAGE_BATCH_MAX_REQUESTS', 'MESSAGE_BATCH_MAX_BYTES',"
         " 'MAX_REQUESTS_PER_BATCH', 'MESSAGE_BATCH_RESULTS_DAYS')]))"],
        cwd=ROOT, text=True, capture_output=True, timeout=60,
        env={**{k: v for k, v in os.environ.items() if k not in names}, **env})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.processes
def test_message_batches_default_to_anthropics_limits_unless_the_operator_sets_them() -> None:
    # Anthropic's 100,000 requests and 256 MB, results kept 29 days; OpenAI's 50,000 beside.
    assert _message_batch_limits() == [100_000, 256 * 1024 * 1024, 50_000, 29]
    # An operator's general limits hold on both faces; the face's own settings win.
    assert _message_batch_limits(BATCHWEB_MAX_REQUESTS_PER_BATCH="1000",
                                 BATCHWEB_MAX_FILE_BYTES="5000")[:3] == [1000, 5000, 1000]
    assert _message_batch_limits(BATCHWEB_MAX_REQUESTS_PER_BATCH="1000",
                                 BATCHWEB_MESSAGE_BATCH_MAX_REQUESTS="7")[:3] == [
        7, 256 * 1024 * 1024, 1000]


@pytest.mark.processes
def test_the_service_refuses_to_start_on_a_typo() -> None:
    result = _import_settings(BATCHWEB_SHARD_SIZE="1,000")
    assert result.returncode != 0
    assert "ImproperlyConfigured" in result.stderr
    assert "BATCHWEB_SHARD_SIZE" in result.stderr


@pytest.mark.processes
def test_settings_create_nothing_and_load_no_engine(tmp_path: Path) -> None:
    var = tmp_path / "var"
    result = subprocess.run(
        [sys.executable, "-c",
         "import sys, batchweb.settings; print('engine' in sys.modules)"],
        cwd=ROOT, text=True, capture_output=True, timeout=60,
        env={**os.environ, "BATCHWEB_VAR_DIR": str(var), "BATCHWEB_TMP_DIR": str(var / "tmp")})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
    assert not var.exists()


def test_the_cpu_defaults_get_this_cpus_dtype(settings: object) -> None:
    from engine.vllm_engine import best_cpu_dtype
    from jobs.lib.model_registry import model_spec

    spec = model_spec("SmolLM2-135M-Instruct")
    assert spec is not None
    assert spec.options["dtype"] in ("bfloat16", "float32")
    if not os.environ.get("BATCHWEB_DTYPE"):
        assert spec.options["dtype"] == best_cpu_dtype()


def _database_options(**env: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", "import json, batchweb.settings as s; "
         "print(json.dumps(s.DATABASES['default'].get('OPTIONS', {})))"],
        cwd=ROOT, text=True, capture_output=True, timeout=60, env={**os.environ, **env})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.processes
def test_postgres_sessions_ask_the_server_to_notice_a_dead_host() -> None:
    url = "postgres://batchweb@db.internal:5432/batchweb"
    # A quarter of the heartbeat timeout: a dead host's sessions (and their locks) are
    # dropped within ~2x that, before other workers' waiting heartbeats grow stale.
    options = _database_options(DATABASE_URL=url, BATCHWEB_HEARTBEAT_TIMEOUT_SECONDS="30")
    assert options["options"] == ("-c tcp_keepalives_idle=7 -c tcp_keepalives_interval=2 "
                                  "-c tcp_keepalives_count=3 -c tcp_user_timeout=14000")
    # Options in DATABASE_URL come after them, so they win; 0 sends nothing.
    options = _database_options(
        DATABASE_URL=url + "?options=-c%20tcp_keepalives_idle%3D60",
        BATCHWEB_DB_DEAD_CLIENT_SECONDS="10")
    assert options["options"].startswith("-c tcp_keepalives_idle=10 ")
    assert options["options"].endswith(" -c tcp_keepalives_idle=60")
    assert "options" not in _database_options(DATABASE_URL=url,
                                              BATCHWEB_DB_DEAD_CLIENT_SECONDS="0")
    # PgBouncer refuses startup options: behind it none are sent unless asked for.
    assert "options" not in _database_options(DATABASE_URL=url, DB_TRANSACTION_POOLING="1")
    assert _database_options(DATABASE_URL=url, DB_TRANSACTION_POOLING="1",
                             BATCHWEB_DB_DEAD_CLIENT_SECONDS="10")["options"].startswith(
        "-c tcp_keepalives_idle=10 ")


@pytest.mark.django_db
def test_a_postgres_session_has_the_keepalives(settings: object) -> None:
    from django.db import connection

    if connection.vendor != "postgresql" or not connection.settings_dict["HOST"]:
        pytest.skip("needs PostgreSQL over TCP (DATABASE_URL)")
    with connection.cursor() as cursor:
        cursor.execute("SHOW tcp_keepalives_idle")
        idle = cursor.fetchone()[0]
        cursor.execute("SHOW tcp_user_timeout")
        user_timeout = cursor.fetchone()[0]
    seconds = settings.DB_DEAD_CLIENT_SECONDS  # type: ignore[attr-defined]
    assert idle in (str(seconds), f"{seconds}s")
    assert user_timeout in (str(seconds * 2000), f"{seconds * 2}s")
