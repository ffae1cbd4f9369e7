"""A real `vllm serve` on loopback, for the remote engine's tests and benchmarks.

CPU settings as /work/shared/vllm-cpu-notes.md says (no reserved core, a small KV cache,
offline). The caller holds /tmp/engine.lock: this is an engine like any other.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "var" / "models"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class VllmServe:
    """`vllm serve <folder>` as a child process; `url` is its OpenAI base URL."""

    def __init__(self, folder: str, name: str, *args: str, log: Path | None = None,
                 kv_cache_gib: int = 1) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.name = name
        env = {**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
               "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
        # `vllm serve`'s own entry point: the `vllm` command asks for the distribution
        # "vllm" by name, which the CPU build (vllm-cpu) is not.
        command = [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry",
                   "--model", str(MODELS / folder),
                   "--served-model-name", name, "--host", "127.0.0.1",
                   "--port", str(self.port), "--enforce-eager", *args]
        self.log = log
        out = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115 (the child's)
        self.proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log.read_text(errors="replace")[-3000:] if self.log else ""
                raise RuntimeError(f"vllm serve exited ({self.proc.returncode}):\n{tail}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code \
                        == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError("vllm serve did not get ready")

    def stop(self) -> None:
        if self.proc.poll() is None:
            # Its engine core is a child of its own: the whole session goes.
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
