"""The compiled engine (engine/compile_cache.py) on SmolLM2-135M-Instruct (CPU): its float32
greedy outputs are eager's, its provenance says it ran compiled, and a second start loads
the compile cache the first one saved instead of compiling again. Three engine starts, one
of them compiling (1-3 minutes on 2 cores): marked `engine`."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import CHAT, EngineRequest, compile_cache, load_engine
from engine.catalog import DEFAULT_MODELS
from engine.prepare import prepare_model
from tests.engine import needs_vllm

pytestmark = [needs_vllm, pytest.mark.engine, pytest.mark.timeout(900)]

PROMPTS = ["What is 2+2?", "Name three colours.", "Write a haiku about the sea.",
           "Explain what a compiler does in one sentence."]


def _answers(model_cache: Path, mode: str) -> tuple[dict[str, str], dict]:
    base = DEFAULT_MODELS[0]
    spec = base.__class__(name="smol", backend="vllm", path=str(prepare_model(base, model_cache)),
                          options={"dtype": "float32", "engine_mode": mode,
                                   "max_model_len": 512, "max_num_seqs": 4})
    engine = load_engine(spec)
    try:
        requests = [EngineRequest(str(i), CHAT, {
            "model": "smol", "messages": [{"role": "user", "content": text}],
            "max_tokens": 24, "temperature": 0}) for i, text in enumerate(PROMPTS)]
        results = {r.request_id: r for r in engine.run(requests)}
        assert all(r.status_code == 200 for r in results.values())
        return ({rid: r.body["choices"][0]["message"]["content"]
                 for rid, r in results.items()}, engine.provenance())
    finally:
        engine.close()


def test_compiled_answers_as_eager_and_its_second_start_loads_the_cache(
        model_cache, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("BATCHWEB_COMPILE_CACHE_DIR", str(cache))
    # What vLLM writes outside a compiled engine's cache; restored afterwards.
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm"))
    monkeypatch.delenv("BATCHWEB_ENGINE_MODE", raising=False)
    monkeypatch.delenv("BATCHWEB_ENFORCE_EAGER", raising=False)

    eager, eager_record = _answers(model_cache, "eager")
    assert eager_record["engine_mode"] == "eager"
    assert not cache.exists() or not any(cache.iterdir())  # eager never writes a cache

    compiled, record = _answers(model_cache, "compiled")
    assert record["engine_mode"] == "compiled"
    assert compiled == eager
    (key,) = cache.iterdir()
    assert compile_cache.is_warm(key)
    (artifact,) = key.glob("torch_compile_cache/torch_aot_compile/*/rank_*/model")
    saved = artifact.stat().st_mtime_ns

    again, _ = _answers(model_cache, "compiled")
    assert again == eager
    # Loaded, not compiled again: vLLM saves its artifact only after compiling.
    assert artifact.stat().st_mtime_ns == saved
    assert [p.name for p in cache.iterdir()] == [key.name]
