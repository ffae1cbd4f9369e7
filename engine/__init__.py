"""Inference engines behind one narrow interface (see engine/base.py).

`load_engine` imports vLLM only when a vLLM model is actually loaded, so the web process
(which imports `engine` for its types) never pays for or depends on it.
"""

from __future__ import annotations

from engine.base import (
    Engine,
    EngineError,
    EngineRequest,
    EngineResult,
    ModelSpec,
)
from engine.endpoints import (
    CHAT,
    COMPLETIONS,
    EMBEDDINGS,
    ENDPOINTS,
    MESSAGES,
    POOLING_ENDPOINTS,
    RERANK,
    RESPONSES,
    SCORE,
)

__all__ = [
    "CHAT",
    "COMPLETIONS",
    "EMBEDDINGS",
    "ENDPOINTS",
    "MESSAGES",
    "POOLING_ENDPOINTS",
    "RERANK",
    "RESPONSES",
    "SCORE",
    "Engine",
    "EngineError",
    "EngineRequest",
    "EngineResult",
    "ModelSpec",
    "load_engine",
]


def load_engine(spec: ModelSpec) -> Engine:
    """Start the engine for `spec` (blocks until it is ready; vLLM takes ~30 s on CPU)."""
    if spec.backend == "vllm":
        from engine.reaper import reap_children_on_exit
        from engine.vllm_engine import VllmEngine

        engine = VllmEngine(spec)
        reap_children_on_exit()  # its engine core must not outlive this process
        return engine
    if spec.backend == "echo":
        from engine.echo import EchoEngine

        return EchoEngine(spec)
    if spec.backend == "remote":
        from engine.remote import RemoteEngine

        return RemoteEngine(spec)
    raise EngineError(f"unknown backend {spec.backend!r} for model {spec.name!r}")
