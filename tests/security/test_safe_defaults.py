"""Safe by default: without DEBUG the service needs a real SECRET_KEY and speaks HTTPS only,
unless told otherwise; `make install` gives a laptop a key of its own."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from batchweb.secret_key import SECRET_KEY_FILE, ensure_secret_key
from tests.factories import ROOT

# Its tests start the service's settings in processes of their own.
pytestmark = pytest.mark.processes

GOOD_KEY = "Xy7-Qp2_Lm9#" * 5


def _settings(code: str, *, key_file: Path, **env: str | None) -> subprocess.CompletedProcess:
    """Import batchweb.settings in a fresh process with `env` (None: unset) and the checkout's
    key file at `key_file`, then run `code`."""
    child = {k: v for k, v in os.environ.items()
             if k not in ("DJANGO_SETTINGS_MODULE", "SECRET_KEY", "DEBUG", "BATCHWEB_HTTPS")}
    child.update({k: v for k, v in env.items() if v is not None})
    script = (f"from pathlib import Path\nimport batchweb.secret_key\n"
              f"batchweb.secret_key.SECRET_KEY_FILE = Path({str(key_file)!r})\n"
              f"from batchweb import settings as s\n{code}")
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=child, text=True,
                          capture_output=True, timeout=60)


@pytest.mark.parametrize("key", [
    None,  # neither SECRET_KEY nor a key file: the development key
    "dev-only-insecure-key-change-me",
    "x" * 30 + "abcdefghijklmnopqr",  # 48 characters
    "django-insecure-" + GOOD_KEY,
    "ab" * 40,  # long, but two characters
])
def test_without_debug_the_service_refuses_a_weak_or_default_key(
        tmp_path: Path, key: str | None) -> None:
    result = _settings("print('started')", key_file=tmp_path / "missing", SECRET_KEY=key,
                       DEBUG="0")
    assert result.returncode != 0
    assert "ImproperlyConfigured" in result.stderr and "SECRET_KEY" in result.stderr
    assert "started" not in result.stdout


def test_debug_runs_on_the_development_key(tmp_path: Path) -> None:
    result = _settings("print(s.SECRET_KEY)", key_file=tmp_path / "missing", DEBUG="1")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "dev-only-insecure-key-change-me"


def test_a_strong_key_from_the_environment_is_used(tmp_path: Path) -> None:
    result = _settings("print(s.SECRET_KEY)", key_file=tmp_path / "missing",
                       SECRET_KEY=GOOD_KEY, DEBUG="0")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == GOOD_KEY


def test_make_install_writes_a_key_once_that_every_run_of_the_checkout_finds(
        tmp_path: Path) -> None:
    # The checkout's var/, not BATCHWEB_VAR_DIR: benchmarks run on scratch VAR_DIRs.
    assert SECRET_KEY_FILE == ROOT / "var" / "secret_key"
    assert "ensure_secret_key()" in (ROOT / "Makefile").read_text()
    key_file = tmp_path / "checkout" / "var" / "secret_key"
    ensure_secret_key(key_file)
    key = key_file.read_text().strip()
    assert len(key) >= 80
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    ensure_secret_key(key_file)  # a second `make` keeps it
    assert key_file.read_text().strip() == key
    assert [p.name for p in key_file.parent.iterdir()] == ["secret_key"]
    result = _settings("print(s.SECRET_KEY)", key_file=key_file, DEBUG="0",
                       BATCHWEB_VAR_DIR=str(tmp_path / "scratch"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == key
    # A SECRET_KEY in the environment wins over the file.
    result = _settings("print(s.SECRET_KEY)", key_file=key_file, DEBUG="0",
                       SECRET_KEY=GOOD_KEY)
    assert result.stdout.strip() == GOOD_KEY


HTTPS_SETTINGS = """
import json
print(json.dumps({name: getattr(s, name, None) for name in (
    "SECURE_SSL_REDIRECT", "SESSION_COOKIE_SECURE", "CSRF_COOKIE_SECURE",
    "SECURE_HSTS_SECONDS", "SECURE_PROXY_SSL_HEADER")}))
"""


@pytest.mark.parametrize(("env", "https"), [
    ({"DEBUG": "0"}, True),  # the default without DEBUG
    ({"DEBUG": "0", "BATCHWEB_HTTPS": "0"}, False),  # the opt-out for plain HTTP on loopback
    ({"DEBUG": "1"}, False),
    ({"DEBUG": "1", "BATCHWEB_HTTPS": "1"}, True),
])
def test_https_follows_from_debug_off_with_an_explicit_opt_out(
        tmp_path: Path, env: dict[str, str], https: bool) -> None:
    result = _settings(HTTPS_SETTINGS, key_file=tmp_path / "missing", SECRET_KEY=GOOD_KEY,
                       **env)
    assert result.returncode == 0, result.stderr
    values = json.loads(result.stdout.strip().splitlines()[-1])
    if https:
        assert values == {"SECURE_SSL_REDIRECT": True, "SESSION_COOKIE_SECURE": True,
                          "CSRF_COOKIE_SECURE": True, "SECURE_HSTS_SECONDS": 31536000,
                          "SECURE_PROXY_SSL_HEADER": ["HTTP_X_FORWARDED_PROTO", "https"]}
    else:
        assert not any(values.values()), values


def test_make_run_and_the_tests_opt_out_of_https_for_loopback() -> None:
    from django.conf import settings

    assert os.environ["BATCHWEB_HTTPS"] == "0"  # tests/settings.py, inherited by children
    assert not getattr(settings, "SECURE_SSL_REDIRECT", False)
    makefile = (ROOT / "Makefile").read_text()
    assert "BATCHWEB_HTTPS=0 $(PY) manage.py runservice" in makefile
    assert "bench: export BATCHWEB_HTTPS=0" in makefile


@pytest.mark.parametrize("token", [
    "CHANGE_ME",  # deploy/k8s/secret.yaml.example's placeholder
    "change-me-" + "Xy7Qp2Lm9Zr4Tk8Wd3" * 2,  # long, but a placeholder left in
    "multihost-metrics-token",  # 23 characters
    "abcd" * 16,  # long, but four characters
])
def test_without_debug_the_service_refuses_a_placeholder_or_weak_metrics_token(
        tmp_path: Path, token: str) -> None:
    result = _settings("print('started')", key_file=tmp_path / "missing", SECRET_KEY=GOOD_KEY,
                       BATCHWEB_METRICS_TOKEN=token, DEBUG="0")
    assert result.returncode != 0
    assert "ImproperlyConfigured" in result.stderr
    assert "BATCHWEB_METRICS_TOKEN" in result.stderr and token not in result.stderr
    assert "started" not in result.stdout


@pytest.mark.parametrize("token", ["", "0f3c9a1be27d48c6a5f1e09b7d2c4e8a"])
def test_an_empty_or_strong_metrics_token_starts(tmp_path: Path, token: str) -> None:
    result = _settings("print(repr(s.BATCHWEB['METRICS_TOKEN']))", key_file=tmp_path / "missing",
                       SECRET_KEY=GOOD_KEY, BATCHWEB_METRICS_TOKEN=token, DEBUG="0")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == repr(token)
