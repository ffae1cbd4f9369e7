"""The checkout's SECRET_KEY file: read by the settings (and manage.py's help), written once
by `make install` before any settings can load."""

from __future__ import annotations

import os
import secrets
import tempfile
from pathlib import Path

# In the checkout's var/, not BATCHWEB_VAR_DIR: benchmarks and tests give each run a scratch
# VAR_DIR, and every one of them must sign with the same key as `make run`.
SECRET_KEY_FILE = Path(__file__).resolve().parent.parent / "var" / "secret_key"


def ensure_secret_key(path: Path = SECRET_KEY_FILE) -> Path:
    """Write a random SECRET_KEY to `path` unless one is there (`make install` runs this), so
    a laptop never runs on a key that is published in the source."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, scratch = tempfile.mkstemp(dir=path.parent, prefix=".secret_key-")  # mode 0600
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_urlsafe(64) + "\n")
        # link() publishes the whole file at once and fails if a key is there: a process
        # never reads a half-written key, and two `make` runs never replace each other's.
        os.link(scratch, path)
    except FileExistsError:
        pass
    finally:
        os.unlink(scratch)
    return path
