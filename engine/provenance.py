"""What ran: the record an engine gives of itself, for every shard a worker runs.

A batch's answers depend on more than its model's name: the weights and tokenizer files,
the adapter's, the engine and its version, the dtype, the parallelism and the sampling
defaults the engine fills in for what a request leaves unset. `Provenance` holds them; the
worker records it on each shard it claims (jobs.services.what_ran), so two batches a month
apart on the "same" model can be told apart.

Content hashes are computed once per folder and kept beside it (`HASH_CACHE`, inside the
folder): later starts read the cached value while every file's size and modification time
are unchanged, so a worker's start pays for hashing only after the files changed.

No Django here, as everywhere in `engine/`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# The cache of a folder's content hash, inside the folder (a rebuilt folder drops it with
# the rest). Never part of the hash itself, nor is the source marker (engine/prepare.py):
# the hash is of what the engine loads.
HASH_CACHE = ".batchweb-content-hash.json"
_NOT_HASHED = {HASH_CACHE, ".batchweb-source"}


def _files(folder: Path) -> list[Path]:
    """Every regular file under `folder` the engine may read, in a stable order."""
    found = []
    for dirpath, dirnames, names in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(names):
            if name in _NOT_HASHED or name.startswith("."):
                continue
            found.append(Path(dirpath) / name)
    return found


def _stats(folder: Path, files: list[Path]) -> dict[str, list[int]]:
    return {str(p.relative_to(folder)): [p.stat().st_size, p.stat().st_mtime_ns] for p in files}


def content_hash(folder: str | Path) -> str:
    """sha256 over a folder's files (weights, tokenizer, config: each file's relative path
    and content), computed once and cached beside them while no file changes."""
    folder = Path(folder)
    files = _files(folder)
    stats = _stats(folder, files)
    cache = folder / HASH_CACHE
    try:
        cached = json.loads(cache.read_text())
        if cached.get("files") == stats and isinstance(cached.get("sha256"), str):
            return str(cached["sha256"])
    except (OSError, ValueError):
        pass
    digest = hashlib.sha256()
    for path in files:
        digest.update(str(path.relative_to(folder)).encode() + b"\0")
        with path.open("rb") as handle:
            digest.update(hashlib.file_digest(handle, "sha256").digest())
    value = digest.hexdigest()
    try:
        partial = folder / f"{HASH_CACHE}.{os.getpid()}"
        partial.write_text(json.dumps({"sha256": value, "files": stats}))
        partial.replace(cache)
    except OSError:  # a read-only folder: hashed again at the next start
        log.warning("cannot cache the content hash of %s", folder)
    return value


@dataclass(frozen=True)
class Provenance:
    """What one engine is: the model's files and where they came from, the engine, how it
    computes (dtype, parallelism, eager or compiled), and the sampling defaults it applies
    to what a request leaves unset."""

    model: str
    model_source: str
    model_sha256: str
    engine: str
    engine_version: str
    dtype: str
    parallelism: dict[str, int] = field(default_factory=dict)
    # How the engine ran the model: "eager" or "compiled" (vLLM's torch.compile: the same
    # greedy float32 outputs, other speed); empty for an engine without the choice.
    engine_mode: str = ""
    sampling_defaults: dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def serving_key(record: dict[str, Any]) -> str:
    """The model's files and the engine's version of a provenance record, as one string:
    an operator's eval set runs again whenever a worker first serves a new one."""
    return "|".join(str(record.get(name, "")) for name in
                    ("model", "model_sha256", "engine", "engine_version"))


def adapter_record(name: str, source: str, folder: str | Path) -> dict[str, str]:
    """A LoRA adapter's part of a shard's provenance."""
    return {"name": name, "source": source, "sha256": content_hash(folder)}
