"""Settings for the test suite: the service's own, plus the echo model for pipeline tests,
short timings so heartbeats and the reconciler act within a test's patience, and a storage
of the tests' own. Worker processes started by tests inherit this module through
DJANGO_SETTINGS_MODULE."""

import os
import tempfile
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

_ROOT = Path(__file__).resolve().parent.parent
_STORAGE_DIR = str(_ROOT / "var" / "test-storage")


def _redis_url_of_process(url: str, index: int) -> str:
    """URL on the database `index` places after its own (before it, past Redis's 16)."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    unix = parts.scheme == "unix"
    base = int(query.get("db", 0) if unix else parts.path.strip("/") or 0)
    db = base + index if base + index < 16 else base - index
    if unix:  # unix:///path?db=N (urlunsplit would drop the "//")
        return f"unix://{parts.path}?{urlencode({**query, 'db': db})}"
    return urlunsplit(parts._replace(path=f"/{db}"))


# pytest-xdist runs the suite in several processes (`make check`). pytest-django gives each
# its own test database; each also gets a Redis database, a storage folder and a scratch
# folder of its own, which the worker processes its tests start inherit (once: they import
# this module too).
_XDIST_PROCESS = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw0", "gw1", ...
if _XDIST_PROCESS and os.environ.get("BATCHWEB_TESTS_PROCESS") != _XDIST_PROCESS:
    os.environ["BATCHWEB_TESTS_PROCESS"] = _XDIST_PROCESS
    os.environ["REDIS_URL"] = _redis_url_of_process(
        os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"), int(_XDIST_PROCESS[2:]))
    # The controlling process read this module first and set the folder every process
    # inherits: each takes its own beside it.
    os.environ["BATCHWEB_STORAGE_DIR"] = "-".join((
        os.environ.get("BATCHWEB_STORAGE_DIR", _STORAGE_DIR),
        _XDIST_PROCESS))
    # The scratch folder too: a test that runs the cleanup pass a few days ahead sweeps
    # every file in it, another process's validation lists in use included.
    if "BATCHWEB_TMP_DIR" in os.environ:
        os.environ["BATCHWEB_TMP_DIR"] += f"-{_XDIST_PROCESS}"
for _name, _value in {
    "BATCHWEB_ECHO_MODEL": "1",
    # Live-server threads must not keep connections, or the test database cannot be dropped.
    "DB_CONN_MAX_AGE": "0",
    "BATCHWEB_HEARTBEAT_SECONDS": "1",
    "BATCHWEB_HEARTBEAT_TIMEOUT_SECONDS": "6",
    "BATCHWEB_RECONCILE_SECONDS": "2",
    "BATCHWEB_SHARD_RETRY_BASE_SECONDS": "1",
    "BATCHWEB_STORAGE_DIR": _STORAGE_DIR,
    # Scratch of this test session only (its worker processes inherit it): workers sweep
    # TMP_DIR of parts whose shard is not running in *their* database, so a session must
    # not share it with `make run` or another session.
    "BATCHWEB_TMP_DIR": os.path.join(tempfile.gettempdir(), f"batchweb-tests-{os.getpid()}"),
    # DEBUG is off in tests, so the service wants a real key; in the environment, so the
    # worker and server processes the tests start sign with the same one.
    "SECRET_KEY": "tests-only-" + "q7Lm2Xv9Rk4Tz8Wp3Hs6Jd1Fb5Nc0Yg-" * 2,
    # A prefix cache of a few requests: the tests' shared-prefix files of a few hundred
    # lines then hold more prefixes than it, as real files do a real engine's cache.
    "BATCHWEB_PREFIX_CACHE_TOKENS": "400",
    # Live servers and Granian in the tests speak plain HTTP on loopback.
    "BATCHWEB_HTTPS": "0",
}.items():
    os.environ.setdefault(_name, _value)

from batchweb.settings import *  # noqa: E402, F403

# Django's default hasher spends ~0.3 s of CPU on every password set or checked: a test
# user does not need that (the service's own settings keep the default).
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
