"""The engine's mode (eager or compiled) and where a compiled engine keeps its compile cache.

Compiled (torch.compile through vLLM) computes more tokens/s (on CPU 1.05-1.14x in fp32,
more in bf16: bench/RESULTS.md) but compiles for 70-170 s; vLLM saves what it compiled and
a later start loads it in seconds (vLLM's AOT artifact and inductor's kernels, under
`VLLM_CACHE_ROOT`). vLLM keys that artifact by its own configuration and the source files
it traced, not by the weights' content, and torch's artifacts are tied to the torch build.
So each (model content hash, dtype, vLLM, torch) gets a directory of its own, `cache_dir`,
which vLLM's cache root points at: a changed model or engine never reads another's
artifacts, only compiles anew beside them.

The directory lives with the worker's state: `BATCHWEB_COMPILE_CACHE_DIR`, by default
`compile-cache/` of the var dir (`BATCHWEB_VAR_DIR`, else the checkout's `var/`), a volume
in deployments, so it survives a restart.

Modes (`engine_mode` of a model's options, or `BATCHWEB_ENGINE_MODE` over every model):
- `compiled`: compile, or load the cache (deployments' default);
- `eager`: never compile;
- `auto` (the default of `make run` and the CPU defaults): compiled when this key's cache
  is warm; otherwise eager on the first start for the key and compiled from the second
  (which fills the cache). A first start stays as quick as eager, the quickstart's case.

No Django here, as everywhere in `engine/`.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

MODES = ("eager", "compiled", "auto")
# Written in a key's directory once an engine of the key started (eager or not): `auto`
# compiles from the next start on.
STARTED = "started.json"
# vLLM's AOT artifact of a compiled model, relative to its cache root.
_ARTIFACTS = "torch_compile_cache/torch_aot_compile"


def requested_mode(options: dict[str, Any], environ: Mapping[str, str] | None = None) -> str:
    """The mode asked for: BATCHWEB_ENGINE_MODE (or the older BATCHWEB_ENFORCE_EAGER) over
    every model, else the model's `engine_mode`, else its `enforce_eager`, else vLLM's
    default (compiled)."""
    env = os.environ if environ is None else environ
    if env.get("BATCHWEB_ENGINE_MODE"):
        return check_mode(env["BATCHWEB_ENGINE_MODE"], "BATCHWEB_ENGINE_MODE")
    if env.get("BATCHWEB_ENFORCE_EAGER"):
        eager = env["BATCHWEB_ENFORCE_EAGER"].strip().lower() in ("1", "true", "yes", "on")
        return "eager" if eager else "compiled"
    if options.get("engine_mode"):
        return check_mode(str(options["engine_mode"]), "engine_mode")
    if "enforce_eager" in options:
        return "eager" if options["enforce_eager"] else "compiled"
    return "compiled"


def check_mode(mode: str, name: str) -> str:
    mode = mode.strip().lower()
    if mode not in MODES:
        raise ValueError(f"{name} must be one of {', '.join(MODES)}, not {mode!r}")
    return mode


def cache_root(environ: Mapping[str, str] | None = None) -> Path:
    """Where every key's directory lives."""
    env = os.environ if environ is None else environ
    if env.get("BATCHWEB_COMPILE_CACHE_DIR"):
        return Path(env["BATCHWEB_COMPILE_CACHE_DIR"])
    var = env.get("BATCHWEB_VAR_DIR") or Path(__file__).resolve().parent.parent / "var"
    return Path(var) / "compile-cache"


def cache_key(*, model_sha256: str, dtype: str, vllm_version: str,
              torch_version: str) -> dict[str, str]:
    """What a compiled artifact depends on beyond vLLM's own key (its configuration and
    traced sources): the weights' content, the dtype, the vLLM and torch builds."""
    if not model_sha256:
        raise ValueError("a compile cache key needs the model's content hash")
    return {"model_sha256": model_sha256, "dtype": dtype or "auto",
            "vllm": vllm_version, "torch": torch_version}


def cache_dir(key: dict[str, str], root: Path | None = None) -> Path:
    """The directory of `key`: its digest, so that any change of a factor is another one."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return (cache_root() if root is None else root) / digest


def is_warm(directory: Path) -> bool:
    """Whether a compiled engine saved its artifact here."""
    return any((directory / _ARTIFACTS).glob("*/rank_*/model"))


def was_started(directory: Path) -> bool:
    return (directory / STARTED).is_file()


def choose(mode: str, directory: Path) -> str:
    """eager or compiled, for `mode` and the state of the key's directory."""
    if mode != "auto":
        return mode
    return "compiled" if is_warm(directory) or was_started(directory) else "eager"


def mark_started(directory: Path, key: dict[str, str], mode: str) -> None:
    """Note that the key's engine started (what the key is, readable by an operator)."""
    directory.mkdir(parents=True, exist_ok=True)
    partial = directory / f"{STARTED}.{os.getpid()}"
    partial.write_text(json.dumps({**key, "last_mode": mode}, indent=1))
    partial.replace(directory / STARTED)
