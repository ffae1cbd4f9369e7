"""Settings for batchweb.

Everything an operator changes comes from the environment, with defaults that run the whole
service on one laptop: SQLite, a private Redis started by `make run`, files under ./var.
"""

import json
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import dj_database_url
from django.core.checks.security.base import (
    SECRET_KEY_INSECURE_PREFIX,
    SECRET_KEY_MIN_LENGTH,
    SECRET_KEY_MIN_UNIQUE_CHARACTERS,
)
from django.core.exceptions import ImproperlyConfigured

from batchweb.secret_key import SECRET_KEY_FILE

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("BATCHWEB_VAR_DIR", BASE_DIR / "var"))

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def env_bool(name: str, default: bool = False) -> bool:
    # A typo must not silently read as false: an operator who writes DEBUG=flase or
    # BATCHWEB_HTTPS=ture gets told at start, not a service configured otherwise.
    value = os.environ.get(name)
    if value is None:
        return default
    if value.strip().lower() in _TRUE:
        return True
    if value.strip().lower() in _FALSE:
        return False
    raise ImproperlyConfigured(
        f"{name}={value!r} is not a boolean: use one of {', '.join(_TRUE + _FALSE[:-1])}.")


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ImproperlyConfigured(f"{name}={value!r} is not an integer.") from None


def env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return float(value)
    except ValueError:
        raise ImproperlyConfigured(f"{name}={value!r} is not a number.") from None


DEBUG = env_bool("DEBUG", False)

# The key signs sessions, CSRF tokens and password-reset links: whoever knows it can forge a
# staff session. `make install` writes a random one to the checkout's var/secret_key once
# (batchweb.secret_key.ensure_secret_key) so `make run` and the benchmarks, whose scratch
# BATCHWEB_VAR_DIR is elsewhere, all find it; a deployment sets SECRET_KEY. Without DEBUG the
# service refuses the development key and any key `check --deploy` would call weak.
DEV_SECRET_KEY = "dev-only-insecure-key-change-me"
# The words a template's placeholders are made of (deploy/k8s/secret.yaml.example's
# CHANGE_ME, the development key's change-me).
SECRET_PLACEHOLDERS = ("change_me", "change-me", "changeme")


def weak_secret(value: str, *, min_length: int) -> bool:
    """The one rule for a secret an operator sets (SECRET_KEY, the /metrics token): what
    `check --deploy` calls a weak SECRET_KEY (shorter than its minimum, fewer than
    SECRET_KEY_MIN_UNIQUE_CHARACTERS distinct characters, Django's insecure prefix), or a
    placeholder left in."""
    return (len(value) < min_length or len(set(value)) < SECRET_KEY_MIN_UNIQUE_CHARACTERS
            or value.startswith(SECRET_KEY_INSECURE_PREFIX)
            or any(word in value.lower() for word in SECRET_PLACEHOLDERS))


SECRET_KEY = os.environ.get("SECRET_KEY") or (
    SECRET_KEY_FILE.read_text().strip() if SECRET_KEY_FILE.exists() else DEV_SECRET_KEY)
if not DEBUG and weak_secret(SECRET_KEY, min_length=SECRET_KEY_MIN_LENGTH):
    raise ImproperlyConfigured(
        f"SECRET_KEY is the development key or too weak (at least {SECRET_KEY_MIN_LENGTH} "
        f"random characters): set SECRET_KEY, or run `make install` to write "
        f"{SECRET_KEY_FILE}. Only DEBUG=1 runs with the development key.")
ALLOWED_HOSTS = os.environ.get("ALLOWED_HOSTS", "localhost,127.0.0.1,[::1],testserver").split(",")
CSRF_TRUSTED_ORIGINS = [o for o in os.environ.get("CSRF_TRUSTED_ORIGINS", "").split(",") if o]

INSTALLED_APPS = [
    "batchweb.apps.AdminConfig",  # the admin's modules loaded by the URLconf (see there)
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "whitenoise.runserver_nostatic",
    "django.contrib.staticfiles",
    "django_htmx",
    "django_rq",
    "template_partials",
    "axes",
    "jobs",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    # Outermost but one: every page gets it, Django's error pages and django-axes' too.
    "jobs.http.csp.ContentSecurityPolicyMiddleware",
    "jobs.api.body_limit.BodySizeLimitMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    # Last, as django-axes asks: it turns a locked-out login into its lockout answer.
    "axes.middleware.AxesMiddleware",
]

# The API (/v1/) authenticates each request by its key, sets no cookie and has no pages or
# forms: its requests skip the middlewares only pages need (batchweb/wsgi.py).
PAGE_ONLY_MIDDLEWARE = {
    "jobs.http.csp.ContentSecurityPolicyMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    "axes.middleware.AxesMiddleware",
}
API_MIDDLEWARE = [m for m in MIDDLEWARE if m not in PAGE_ONLY_MIDDLEWARE]

ROOT_URLCONF = "batchweb.urls"
WSGI_APPLICATION = "batchweb.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DATABASES = {
    "default": dj_database_url.parse(
        os.environ.get("DATABASE_URL", f"sqlite:///{VAR_DIR / 'batchweb.sqlite3'}"),
        # Workers hold connections for hours; let Django check them before use so a
        # restarted or terminated PostgreSQL backend is replaced instead of failing a shard.
        conn_max_age=env_int("DB_CONN_MAX_AGE", 60),
        conn_health_checks=True,
    )
}
if env_bool("DB_TRANSACTION_POOLING"):
    # Behind a pooler in transaction mode (PgBouncer's pool_mode = transaction), where a
    # fleet's many connections share a few of PostgreSQL's: a cursor may not outlive its
    # transaction, so querysets' iterator() reads in chunks of a client-side cursor.
    DATABASES["default"]["DISABLE_SERVER_SIDE_CURSORS"] = True
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    # Web, worker and scheduler share one SQLite file on a laptop: wait for the lock
    # instead of failing, and let readers run beside the writer.
    DATABASES["default"]["OPTIONS"] = {
        "timeout": 30,
        "transaction_mode": "IMMEDIATE",
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
    }
    # Tests start real worker processes: the test database must be a file they can open.
    DATABASES["default"]["TEST"] = {"NAME": str(VAR_DIR / "test.sqlite3")}

# PostgreSQL learns that a client machine died only from TCP. A worker host that dies (power,
# kernel panic, a cut network) while one of its sessions is inside a transaction leaves that
# session holding its row locks (a batch's, a shard's) until the kernel gives up on the
# connection, two hours and more by default, and every other worker that touches the batch
# waits on them, its shard heartbeats too. So every session asks the server to probe it once
# it has been quiet for BATCHWEB_DB_DEAD_CLIENT_SECONDS and to drop it when the probes (or
# data it sent) go unanswered: a lost host's locks go within about twice that. A live client
# answers the probes however long it stays in a transaction. The default, a quarter of the
# heartbeat timeout, frees the locks before the other workers' waiting heartbeats grow
# stale. 0 leaves the server's own settings. Behind a pooler (DB_TRANSACTION_POOLING) it is 0
# unless set: PgBouncer refuses startup `options`, and the sessions PostgreSQL sees are the
# pooler's, so it is the pooler that must notice a dead client (its tcp_keepalive settings
# and idle_transaction_timeout; see docs/operations.md, "Scaling").
DB_DEAD_CLIENT_SECONDS = env_int(
    "BATCHWEB_DB_DEAD_CLIENT_SECONDS",
    0 if env_bool("DB_TRANSACTION_POOLING")
    else max(1, env_int("BATCHWEB_HEARTBEAT_TIMEOUT_SECONDS", 30) // 4))
if DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql" and DB_DEAD_CLIENT_SECONDS:
    _options = DATABASES["default"].setdefault("OPTIONS", {})
    _interval = max(1, DB_DEAD_CLIENT_SECONDS // 3)
    _keepalives = (f"-c tcp_keepalives_idle={DB_DEAD_CLIENT_SECONDS} "
                   f"-c tcp_keepalives_interval={_interval} -c tcp_keepalives_count=3 "
                   f"-c tcp_user_timeout={2 * DB_DEAD_CLIENT_SECONDS * 1000}")
    # Options given in DATABASE_URL (?options=...) come after, so they win.
    _options["options"] = f"{_keepalives} {_options.get('options', '')}".strip()

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]
# Login throttling (django-axes), on the dashboard's and the admin's login alike: both go
# through authenticate(), which AxesStandaloneBackend guards. Failures count per
# (username, IP) and per IP, never per username alone: a lock on a username could be set off
# by anyone anywhere, locking its owner out (lockout abuse). So an address gets
# LOGIN_FAILURES_PER_USER guesses at one account, and LOGIN_FAILURES_PER_IP across all
# accounts (credential stuffing from one place); the owner, signing in from elsewhere, is not
# affected. A lock lifts after AXES_COOLOFF_TIME without failures; distributed guessing is
# left to the password validators above.
# batchweb.auth.ModelBackend is Django's, with a cheaper lookup of a session's user. A
# session records the backend that signed it in: one of Django's own ModelBackend (before
# this one replaced it) is signed out once.
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "batchweb.auth.ModelBackend",
]
LOGIN_FAILURES_PER_USER = 5
LOGIN_FAILURES_PER_IP = 20
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"], "ip_address"]
AXES_FAILURE_LIMIT = "jobs.http.throttle.login_failure_limit"
AXES_COOLOFF_TIME = timedelta(minutes=15)
# A success must not reset the address's count: an attacker with an account of their own
# could sign in between guesses to start over.
AXES_RESET_ON_SUCCESS = False
# Reverse proxies between the clients and Granian (0: none), for the client's address.
BATCHWEB_PROXY_COUNT = env_int("BATCHWEB_PROXY_COUNT", 0)
AXES_CLIENT_IP_CALLABLE = "jobs.http.throttle.client_ip"
# Django's database sessions, read with a cheaper query (see jobs/http/sessions.py).
SESSION_ENGINE = "jobs.http.sessions"
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "batch_list"
LOGOUT_REDIRECT_URL = "login"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = BASE_DIR / "staticfiles"
STATICFILES_DIRS = [BASE_DIR / "static"]

# Uploaded and produced files. Never served directly: only through views that check the owner
# (or, with BATCHWEB_DOWNLOAD_REDIRECT, a presigned URL of a few seconds handed out by them).
# The filesystem is the embedded default; for several machines point BATCHWEB_STORAGE_DIR at
# shared storage, or set BATCHWEB_STORAGE_BACKEND=s3 and the BATCHWEB_S3_* variables
# (jobs/storage/backends.py streams ranges, multipart writes and server-side copies on top of
# django-storages' S3Storage). Another dotted storage class is used with its own defaults.
STORAGE_DIR = Path(os.environ.get("BATCHWEB_STORAGE_DIR", VAR_DIR / "storage"))
STORAGE_BACKEND = os.environ.get("BATCHWEB_STORAGE_BACKEND", "filesystem").strip()
_S3_BACKENDS = ("s3", "storages.backends.s3.S3Storage", "storages.backends.s3boto3.S3Boto3Storage")


def s3_storage_options() -> dict:
    """django-storages' S3Storage options from the BATCHWEB_S3_* variables."""
    bucket = os.environ.get("BATCHWEB_S3_BUCKET", "").strip()
    if not bucket:
        raise ImproperlyConfigured(
            "BATCHWEB_S3_BUCKET is required with BATCHWEB_STORAGE_BACKEND=s3.")
    from botocore.config import Config

    return {
        "bucket_name": bucket,
        "endpoint_url": os.environ.get("BATCHWEB_S3_ENDPOINT_URL") or None,
        "region_name": os.environ.get("BATCHWEB_S3_REGION") or None,
        # Empty: boto3's own chain (AWS_ACCESS_KEY_ID, a profile, an instance role).
        "access_key": os.environ.get("BATCHWEB_S3_ACCESS_KEY_ID") or None,
        "secret_key": os.environ.get("BATCHWEB_S3_SECRET_ACCESS_KEY") or None,
        "location": os.environ.get("BATCHWEB_S3_PREFIX", "").strip("/"),
        # Names are random and unique: no existence check (a HEAD) before each save.
        "file_overwrite": True,
        "default_acl": None,
        "client_config": Config(
            s3={"addressing_style": "path" if env_bool("BATCHWEB_S3_PATH_STYLE") else "auto"},
            signature_version="s3v4", connect_timeout=10, read_timeout=120,
            retries={"max_attempts": 5, "mode": "standard"}),
    }


if STORAGE_BACKEND in ("", "filesystem"):
    _DEFAULT_STORAGE = {"BACKEND": "django.core.files.storage.FileSystemStorage",
                        "OPTIONS": {"location": str(STORAGE_DIR)}}
elif STORAGE_BACKEND in _S3_BACKENDS:
    _DEFAULT_STORAGE = {"BACKEND": "storages.backends.s3.S3Storage",
                        "OPTIONS": s3_storage_options()}
else:
    _DEFAULT_STORAGE = {"BACKEND": STORAGE_BACKEND, "OPTIONS": {}}
STORAGES = {
    "default": _DEFAULT_STORAGE,
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedStaticFilesStorage"},
}
# Downloads stream through the web process; with this on (object storage only) the owner
# check is followed by a redirect to a presigned URL valid BATCHWEB_DOWNLOAD_URL_SECONDS.
DOWNLOAD_REDIRECT = env_bool("BATCHWEB_DOWNLOAD_REDIRECT", False)
DOWNLOAD_URL_SECONDS = env_int("BATCHWEB_DOWNLOAD_URL_SECONDS", 60)


def data_credentials() -> dict[str, dict[str, Any]]:
    """The credential sets that storage grants (jobs.models.StorageGrant) reach users'
    buckets with, by name: "" is the storage settings' own S3 endpoint and keys (the
    BATCHWEB_S3_* variables, without a bucket: used when the service's storage is not S3;
    on S3 its own connection serves), and NAME the BATCHWEB_DATA_<NAME>_ENDPOINT_URL,
    _REGION, _ACCESS_KEY_ID, _SECRET_ACCESS_KEY and _PATH_STYLE variables. Always the
    service's keys, never a user's."""
    import re

    def one(prefix: str) -> dict[str, Any]:
        return {"endpoint_url": os.environ.get(f"{prefix}ENDPOINT_URL") or None,
                "region_name": os.environ.get(f"{prefix}REGION") or None,
                "access_key": os.environ.get(f"{prefix}ACCESS_KEY_ID") or None,
                "secret_key": os.environ.get(f"{prefix}SECRET_ACCESS_KEY") or None,
                "path_style": env_bool(f"{prefix}PATH_STYLE")}

    sets = {"": one("BATCHWEB_S3_")}
    pattern = re.compile(r"BATCHWEB_DATA_([A-Z0-9]+)_(ENDPOINT_URL|REGION|ACCESS_KEY_ID|"
                         r"SECRET_ACCESS_KEY|PATH_STYLE)")
    for variable in os.environ:
        if match := pattern.fullmatch(variable):
            sets.setdefault(match.group(1), one(f"BATCHWEB_DATA_{match.group(1)}_"))
    return sets


DATA_CREDENTIALS = data_credentials()
# Scratch space for streaming (assembling uploads, writing shard parts before they are stored).
# Local to each machine and to one deployment: workers sweep it of what killed processes left.
# Created where it is first used (jobs.storage.temp.temp_dir), not on import.
TMP_DIR = Path(os.environ.get("BATCHWEB_TMP_DIR", VAR_DIR / "tmp"))
FILE_UPLOAD_TEMP_DIR = str(TMP_DIR)
# Uploads bigger than this go to a temporary file while they arrive, never into memory.
FILE_UPLOAD_MAX_MEMORY_SIZE = 1024 * 1024
# Stored files get the mode the process's umask gives them, not Django's fixed 0644:
# `make run` (runservice) keeps its files private with umask 077.
FILE_UPLOAD_PERMISSIONS = None

# Passed to redis-py unchanged: redis://:password@host/0 authenticates, rediss:// uses TLS.
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
# The cache of the dashboard's heavy views (preflight of a stored file, spot-check samples,
# error counts) lives in that Redis too: every Granian worker and host shares it, where
# Django's default per-process memory would compute each result once per process.
# "local" is each process's own memory, for what is cheaper to compute again than to fetch
# from Redis, and the same for every process (the rendered row of an ended batch).
# (jobs.http.cache.RedisCache is Django's RedisCache, sharing one redis-py client.)
CACHES = {"default": {"BACKEND": "jobs.http.cache.RedisCache",
                      "LOCATION": REDIS_URL, "KEY_PREFIX": "batchweb-cache"},
          "local": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache",
                    "LOCATION": "batchweb-local", "OPTIONS": {"MAX_ENTRIES": 5000}}}
# django-rq's pages are only at /admin/rq/, for superusers (batchweb/urls.py): its own admin
# entry would open them to every staff user.
RQ_SHOW_ADMIN_LINK = False

# --- Batch limits (OpenAI's defaults; operators raise or lower them) ---
BATCHWEB: dict[str, Any] = {
    "MAX_FILE_BYTES": env_int("BATCHWEB_MAX_FILE_BYTES", 200 * 1024 * 1024),
    "MAX_REQUESTS_PER_BATCH": env_int("BATCHWEB_MAX_REQUESTS_PER_BATCH", 50_000),
    "MAX_LINE_BYTES": env_int("BATCHWEB_MAX_LINE_BYTES", 6 * 1024 * 1024),
    "MAX_UPLOAD_BYTES": env_int("BATCHWEB_MAX_UPLOAD_BYTES", 8 * 1024 * 1024 * 1024),
    "MAX_UPLOAD_PART_BYTES": env_int("BATCHWEB_MAX_UPLOAD_PART_BYTES", 64 * 1024 * 1024),
    "MAX_ERRORS_REPORTED": env_int("BATCHWEB_MAX_ERRORS_REPORTED", 1000),
    "MAX_TOKENS_CAP": env_int("BATCHWEB_MAX_TOKENS_CAP", 32_768),
    "SHARD_SIZE": env_int("BATCHWEB_SHARD_SIZE", 1000),
    "SHARD_MAX_ATTEMPTS": env_int("BATCHWEB_SHARD_MAX_ATTEMPTS", 4),
    "SHARD_RETRY_BASE_SECONDS": env_int("BATCHWEB_SHARD_RETRY_BASE_SECONDS", 5),
    # A running shard whose worker has not been heard of for this long is given to another.
    "HEARTBEAT_SECONDS": env_int("BATCHWEB_HEARTBEAT_SECONDS", 5),
    # A worker given several models switches to another once its own queues are empty and
    # the other's shards have waited this long (a switch reloads an engine: tens of
    # seconds on CPU: bench/RESULTS.md, "Model switch").
    "MODEL_SWITCH_SECONDS": env_float("BATCHWEB_MODEL_SWITCH_SECONDS", 60.0),
    "HEARTBEAT_TIMEOUT_SECONDS": env_int("BATCHWEB_HEARTBEAT_TIMEOUT_SECONDS", 30),
    "RECONCILE_SECONDS": env_int("BATCHWEB_RECONCILE_SECONDS", 15),
    # The capacity plan (jobs.capacity.plan, docs/operations.md): the share of a
    # batch's time left that it aims to leave unused (its margin for late workers and
    # estimates), and a worker's output tokens per second assumed for a model of which
    # neither the ledger nor a live worker says anything yet.
    "CAPACITY_MARGIN": env_float("BATCHWEB_CAPACITY_MARGIN", 0.2),
    "DEFAULT_WORKER_TOKENS_PER_SECOND": env_float(
        "BATCHWEB_DEFAULT_WORKER_TOKENS_PER_SECOND", 500.0),
    # A running shard saves its finished results to storage this often (seconds) or after
    # this many new results, whichever comes first; a retry computes only what was not saved.
    "CHECKPOINT_SECONDS": float(os.environ.get("BATCHWEB_CHECKPOINT_SECONDS", "5")),
    "CHECKPOINT_REQUESTS": env_int("BATCHWEB_CHECKPOINT_REQUESTS", 50),
    # A directory where each worker process appends how long its shard claims and
    # heartbeats took (jobs.worker.timings; bench/fleet.py reads them). Empty: not recorded.
    "TIMINGS_DIR": os.environ.get("BATCHWEB_TIMINGS_DIR", ""),
    # Distinct deterministic request bodies remembered per batch for dedup; beyond this,
    # new bodies are simply computed (memory stays bounded for million-line files).
    "DEDUP_MAX_BODIES": env_int("BATCHWEB_DEDUP_MAX_BODIES", 200_000),
    # Prefix planning (jobs.services.prefix_plan): shards run requests grouped by prompt
    # prefix when that serves at least PREFIX_MIN_GAIN of a file's prompt tokens from the
    # engine's prefix cache beyond what file order would. Planning sizes that cache by what
    # the model's live workers report (the smallest: ~47k tokens for the CPU default of 2
    # GiB with SmolLM2-135M, millions on a large GPU); PREFIX_CACHE_TOKENS, when set,
    # overrides it, and PREFIX_CACHE_TOKENS_DEFAULT stands in while no worker reported.
    "PREFIX_GROUPING": env_bool("BATCHWEB_PREFIX_GROUPING", True),
    "PREFIX_CACHE_TOKENS": env_int("BATCHWEB_PREFIX_CACHE_TOKENS", 0),
    "PREFIX_CACHE_TOKENS_DEFAULT": 50_000,
    "PREFIX_MIN_GAIN": env_float("BATCHWEB_PREFIX_MIN_GAIN", 0.10),
    # completion_window bounds, in hours.
    "MIN_WINDOW_HOURS": env_int("BATCHWEB_MIN_WINDOW_HOURS", 1),
    "MAX_WINDOW_HOURS": env_int("BATCHWEB_MAX_WINDOW_HOURS", 168),
    "INPUT_FILE_TTL_DAYS": env_int("BATCHWEB_INPUT_FILE_TTL_DAYS", 30),
    "UPLOAD_TTL_HOURS": env_int("BATCHWEB_UPLOAD_TTL_HOURS", 1),
    # Anthropic's Message Batches: Anthropic's own limits (100,000 requests, a 256 MB create
    # body) unless set; an operator who set the limits above gets those on both faces.
    "MESSAGE_BATCH_MAX_REQUESTS": env_int(
        "BATCHWEB_MESSAGE_BATCH_MAX_REQUESTS",
        env_int("BATCHWEB_MAX_REQUESTS_PER_BATCH", 100_000)),
    "MESSAGE_BATCH_MAX_BYTES": env_int(
        "BATCHWEB_MESSAGE_BATCH_MAX_BYTES",
        env_int("BATCHWEB_MAX_FILE_BYTES", 256 * 1024 * 1024)),
    # Days a Message Batch's results are kept after it ends (Anthropic's 29); then its
    # output and error files expire and it is archived (`archived_at`). 0: kept until
    # deleted.
    "MESSAGE_BATCH_RESULTS_DAYS": env_int("BATCHWEB_MESSAGE_BATCH_RESULTS_DAYS", 29),
}

# --- Models this deployment serves ---
# A JSON list in BATCHWEB_MODELS_FILE replaces the defaults: each entry has name, backend
# ("vllm" or the test-only "echo"), path, endpoints, options (passed to vLLM: dtype, device,
# tensor_parallel_size, max_model_len, max_num_seqs, enforce_eager, ...) and source.
MODELS_DIR = Path(os.environ.get("BATCHWEB_MODELS_DIR", VAR_DIR / "models"))
_CPU_OPTIONS = {
    # Empty: the model registry (jobs.lib.model_registry) picks bf16 only where the CPU has native
    # bf16 (elsewhere it falls back to slow kernels), float32 otherwise.
    "dtype": os.environ.get("BATCHWEB_DTYPE", ""),
    # Eager or compiled (engine/compile_cache.py): auto runs eager on a model's first start
    # (a quickstart as quick as eager) and compiled from then on, loading the compile cache
    # of the var dir. BATCHWEB_ENGINE_MODE=eager|compiled|auto (or BATCHWEB_ENFORCE_EAGER)
    # overrides it for every model, a models file's too.
    "engine_mode": "auto",
    "max_model_len": 2048,
}
# LoRA adapters on the default chat model (registered in the admin). Off unless asked for:
# vLLM's LoRA layers slow every request of the model, with or without an adapter (measured
# bench/RESULTS.md, "LoRA enabled"). vLLM's own options: the largest adapter rank, how many
# adapters one engine step mixes, and how many a worker keeps loaded (the least recently
# used beyond that is dropped, and read again from disk when next asked for).
_LORA_OPTIONS = {
    "enable_lora": True,
    "max_lora_rank": env_int("BATCHWEB_MAX_LORA_RANK", 16),
    "max_loras": env_int("BATCHWEB_MAX_LORAS", 4),
    "max_cpu_loras": env_int("BATCHWEB_MAX_CPU_LORAS", 8),
} if env_bool("BATCHWEB_ENABLE_LORA") else {}
# The default models (engine/catalog.json, declared once), each in its folder under
# MODELS_DIR with this machine's engine options; LoRA on the chat model only.
DEFAULT_MODELS = [
    {**entry, "path": str(MODELS_DIR / entry["name"]),
     "options": {**_CPU_OPTIONS, **entry.get("options", {}),
                 **(_LORA_OPTIONS if "/v1/chat/completions" in entry["endpoints"] else {})}}
    for entry in json.loads((BASE_DIR / "engine" / "catalog.json").read_text())
]
# The test-only echo engine: no "endpoints", so it serves every registered endpoint
# (jobs.lib.model_registry), each answering with its own `echo`.
ECHO_MODEL = {
    "name": "echo-test",
    "backend": "echo",
    "options": {"seconds_per_request": env_float("BATCHWEB_ECHO_SECONDS", 0.0),
                "max_in_flight": env_int("BATCHWEB_ECHO_MAX_IN_FLIGHT", 64),
                # Tests count what the engine computed (recomputation) from this file.
                "request_log": os.environ.get("BATCHWEB_ECHO_REQUEST_LOG", ""),
                # It loads LoRA adapters (as "echo+<adapter>:" answers), at no cost.
                "enable_lora": True,
                # Its context, in words (the engine's default): a request naming no output
                # limit gets what its prompt leaves of it.
                "max_model_len": 2048},
}
if os.environ.get("BATCHWEB_MODELS_FILE"):
    try:
        BATCHWEB_MODELS = json.loads(Path(os.environ["BATCHWEB_MODELS_FILE"]).read_text())
    except (OSError, ValueError) as exc:
        raise ImproperlyConfigured(
            f"BATCHWEB_MODELS_FILE={os.environ['BATCHWEB_MODELS_FILE']!r}: {exc}") from None
else:
    BATCHWEB_MODELS = list(DEFAULT_MODELS)
# The echo engine has no model: it exists for pipeline tests and orchestration benchmarks only.
if env_bool("BATCHWEB_ECHO_MODEL"):
    BATCHWEB_MODELS.append(ECHO_MODEL)

LOG_LEVEL = os.environ.get("LOG_LEVEL", "INFO")
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": LOG_LEVEL},
    # httpx logs every request at INFO: a remote model's worker sends one per batch line.
    # django-axes says it started on every process start, management commands included.
    "loggers": {"django.db.backends": {"level": "WARNING"}, "httpx": {"level": "WARNING"},
                "axes": {"level": "WARNING"}},
}

# Production hardening; `manage.py check --deploy` with DEBUG off is clean.
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
X_FRAME_OPTIONS = "DENY"
SESSION_COOKIE_HTTPONLY = True
# HTTPS is the default wherever DEBUG is off: secure cookies, HSTS, the redirect, and the
# proxy's X-Forwarded-Proto trusted (the proxy terminates TLS and must set it).
# BATCHWEB_HTTPS=0 is the opt-out for plain HTTP on loopback (`make run`, the tests).
if env_bool("BATCHWEB_HTTPS", not DEBUG):
    SECURE_SSL_REDIRECT = True
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 31536000)
    SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    SECURE_HSTS_PRELOAD = True
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")

# --- RQ queues: one control queue, and per model one queue per priority ---
# Workers of a model take its queues in priority order; `jobs.lib.queues` names them.
RQ_QUEUES = {"batchweb": {"URL": REDIS_URL, "DEFAULT_TIMEOUT": 3600}}
for _model in BATCHWEB_MODELS:
    for _priority in ("high", "default", "low"):
        RQ_QUEUES[f"{_model['name']}.{_priority}"] = {"URL": REDIS_URL, "DEFAULT_TIMEOUT": -1}

# --- Operations: metrics, webhooks, cleanup ---


def env_list(name: str) -> list[str]:
    return [item.strip() for item in os.environ.get(name, "").split(",") if item.strip()]


# /metrics answers a request carrying "Authorization: Bearer <token>" (Prometheus'
# bearer_token), or a signed-in staff user. Empty: staff only. Whoever has the token reads
# every model's load and every user's batch counts, so without DEBUG a set token must pass
# SECRET_KEY's rule, at 32 characters (`openssl rand -hex 16` and more).
METRICS_TOKEN_MIN_LENGTH = 32
_METRICS_TOKEN = os.environ.get("BATCHWEB_METRICS_TOKEN", "")
if not DEBUG and _METRICS_TOKEN and weak_secret(_METRICS_TOKEN,
                                                min_length=METRICS_TOKEN_MIN_LENGTH):
    raise ImproperlyConfigured(
        f"BATCHWEB_METRICS_TOKEN is a placeholder or too weak (at least "
        f"{METRICS_TOKEN_MIN_LENGTH} random characters, e.g. `openssl rand -hex 32`), or "
        f"leave it empty for staff sign-in only. Only DEBUG=1 runs with a weak token.")

BATCHWEB.update({
    "METRICS_TOKEN": _METRICS_TOKEN,
    # Where webhooks may be sent. A URL is called only if its host name is listed in
    # ALLOWED_HOSTS (exact, or ".example.com" for subdomains), or every address it
    # resolves to lies in ALLOWED_NETWORKS (CIDRs; "public" means any globally routable
    # address). Both empty (the default): no webhook is ever sent. Loopback and private
    # ranges are never implied; list them explicitly (tests allow 127.0.0.1/32).
    "WEBHOOK_ALLOWED_HOSTS": env_list("BATCHWEB_WEBHOOK_ALLOWED_HOSTS"),
    "WEBHOOK_ALLOWED_NETWORKS": env_list("BATCHWEB_WEBHOOK_ALLOWED_NETWORKS"),
    # Domains that media URLs in request bodies (image_url, input_audio, file, video_url,
    # audio_url content parts) may point to: exact, or ".example.com" for its subdomains.
    # Empty (the default): only data: URLs, carried in the line itself. Anything else would
    # have the engine fetch what a user names, from inside the operator's network.
    "MEDIA_ALLOWED_DOMAINS": env_list("BATCHWEB_MEDIA_ALLOWED_DOMAINS"),
    # One attempt in all (connect, send, read), not one socket wait.
    "WEBHOOK_TIMEOUT_SECONDS": env_float("BATCHWEB_WEBHOOK_TIMEOUT_SECONDS", 5.0),
    # Attempts of one user's events running at once, across all workers; the others wait
    # for the reconciler's next pass. One slow receiver holds at most this many workers.
    "WEBHOOK_MAX_IN_FLIGHT_PER_USER": env_int("BATCHWEB_WEBHOOK_MAX_IN_FLIGHT_PER_USER", 2),
    "WEBHOOK_MAX_ATTEMPTS": env_int("BATCHWEB_WEBHOOK_MAX_ATTEMPTS", 8),
    # Attempt n+1 waits base * 2**(n-1) seconds (30 s, 1 min, 2 min, ... ~1 h).
    "WEBHOOK_RETRY_BASE_SECONDS": env_int("BATCHWEB_WEBHOOK_RETRY_BASE_SECONDS", 30),
    # Uploads (Uploads API) a user may have pending at once: each reserves its declared
    # size in the stored-bytes quota until it is completed, cancelled or expires.
    "MAX_OPEN_UPLOADS": env_int("BATCHWEB_MAX_OPEN_UPLOADS", 10),
    # The reconciler (in every worker) enqueues `cleanup` at most once per interval;
    # 0 turns the schedule off (run `manage.py cleanup` from cron instead).
    "CLEANUP_INTERVAL_SECONDS": env_int("BATCHWEB_CLEANUP_INTERVAL_SECONDS", 3600),
    # Storage objects no row refers to are deleted only once older than this: a file is
    # saved a moment before its row is created, and that moment must not look orphaned.
    "ORPHAN_GRACE_SECONDS": env_int("BATCHWEB_ORPHAN_GRACE_SECONDS", 3600),
    # A scratch file in TMP_DIR (an upload being received, a validation's lists) that was not
    # written to for this long belongs to a process that was killed: the sweep removes it.
    "STALE_TEMP_SECONDS": env_int("BATCHWEB_STALE_TEMP_SECONDS", 6 * 3600),
    # How long a control job (validating or finalizing a batch, a cleanup pass) may run
    # before RQ stops it; the reconciler enqueues it again. A 1M-line validation takes
    # about a minute here, so an hour leaves room for slow storage.
    "CONTROL_JOB_TIMEOUT": env_int("BATCHWEB_CONTROL_JOB_TIMEOUT", 3600),
    # A batch's results delivered to the prefix its owner named (output_prefix): attempts
    # after the finalizer's first, by the reconciler, base * 2**(n-1) seconds apart
    # (1 min, 2, 4, ... ~1 h). The files stay in the Files API whatever happens.
    "DELIVERY_MAX_ATTEMPTS": env_int("BATCHWEB_DELIVERY_MAX_ATTEMPTS", 8),
    "DELIVERY_RETRY_BASE_SECONDS": env_int("BATCHWEB_DELIVERY_RETRY_BASE_SECONDS", 60),
})
