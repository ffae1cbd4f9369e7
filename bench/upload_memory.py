"""Peak memory of the web server while it takes big uploads.

Starts Granian (1 worker) on a scratch SQLite database and storage, then sends
  - a FILE_MB multipart upload through POST /v1/files, and
  - an UPLOAD_MB file through the Uploads API (64 MB parts),
both with the official openai client, and reports the server's peak RSS (VmHWM) after
each. Streaming everywhere means the peak stays flat whatever the size.

    .venv/bin/python bench/upload_memory.py [--file-mb 200] [--upload-mb 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

try:
    from bench import harness
except ImportError:  # run as `python bench/upload_memory.py`: bench/ itself is on the path
    import harness  # type: ignore[no-redef]

LINE = {"custom_id": "", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "SmolLM2-135M-Instruct", "max_tokens": 64,
                 "messages": [{"role": "user", "content": "x" * 300}]}}


def write_jsonl(path: Path, megabytes: int) -> int:
    target = megabytes * 1024 * 1024
    size = 0
    with open(path, "w") as out:
        i = 0
        while size < target:
            LINE["custom_id"] = f"req-{i}"
            line = json.dumps(LINE) + "\n"
            out.write(line)
            size += len(line)
            i += 1
    return size


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--file-mb", type=int, default=200)
    parser.add_argument("--upload-mb", type=int, default=1024)
    harness.add_json_option(parser)
    args = parser.parse_args()

    import openai

    scratch = Path(tempfile.mkdtemp(prefix="bw-upload-bench-"))
    env = {**os.environ, "BATCHWEB_VAR_DIR": str(scratch), "DATABASE_URL": "",
           "BATCHWEB_MAX_FILE_BYTES": str(4 * 1024**3),
           "BATCHWEB_MAX_REQUESTS_PER_BATCH": str(100_000_000)}
    env.pop("DATABASE_URL")
    key = harness.prepare(env)
    port = harness.free_port()
    server = harness.granian(port, env, "--workers", "1", "--blocking-threads", "8",
                             stderr=subprocess.DEVNULL)
    try:
        time.sleep(3)
        worker = harness.web_worker_pid(server)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key,
                               max_retries=0, timeout=900)
        baseline = harness.peak_rss_mb(worker)
        rows: list[tuple[str, float | None, float]] = [("baseline", None, baseline)]

        small = scratch / "multipart.jsonl"
        size = write_jsonl(small, args.file_mb)
        started = time.monotonic()
        with open(small, "rb") as handle:
            client.files.create(file=handle, purpose="batch")
        rows.append((f"POST /v1/files {size / 1e6:.0f} MB", time.monotonic() - started,
                     harness.peak_rss_mb(worker)))
        small.unlink()

        big = scratch / "upload.jsonl"
        size = write_jsonl(big, args.upload_mb)
        started = time.monotonic()
        upload = client.uploads.upload_file_chunked(file=big, mime_type="application/jsonl",
                                                    purpose="batch",
                                                    part_size=64 * 1024 * 1024)
        assert upload.status == "completed", upload
        rows.append((f"Uploads API {size / 1e6:.0f} MB", time.monotonic() - started,
                     harness.peak_rss_mb(worker)))
        print(f"{'what':<28} {'seconds':>8} {'peak RSS MB':>12}")
        for what, seconds, rss in rows:
            shown = "-" if seconds is None else f"{seconds:.1f}"
            print(f"{what:<28} {shown:>8} {rss:>12.0f}")
        harness.write_json(args.json, {"rows": [
            {"what": what, "seconds": seconds, "peak_rss_mb": rss}
            for what, seconds, rss in rows]})
    finally:
        server.terminate()
        server.wait()
        harness.remove(scratch)


if __name__ == "__main__":
    harness.run(main)
