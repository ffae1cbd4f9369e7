"""The real vLLM engine with LoRA adapters on SmolLM2-135M: a request naming an adapter runs
with it, the base model's requests beside it in the same run do not change, and a worker
keeps at most `max_cpu_loras` adapters (the others are read again when next asked for)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import CHAT, COMPLETIONS, EngineRequest, ModelSpec, load_engine
from engine.catalog import DEFAULT_MODELS
from engine.prepare import prepare_model
from engine.vllm_engine import VllmEngine
from tests.engine import needs_vllm
from tests.lora import write_adapter, write_adapter_config

pytestmark = [needs_vllm, pytest.mark.engine, pytest.mark.timeout(900)]

NAME = "smol"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {"one": str(write_adapter(root / "one", seed=1)),
            "two": str(write_adapter(root / "two", seed=2)),
            "empty": str(write_adapter_config(root / "empty"))}  # no weights


@pytest.fixture(scope="module")
def engine(model_cache: Path) -> Iterator[VllmEngine]:
    base = next(s for s in DEFAULT_MODELS if CHAT in s.endpoints)
    spec = ModelSpec(
        name=NAME, backend="vllm", path=str(prepare_model(base, model_cache)),
        endpoints=(CHAT, COMPLETIONS),
        # One adapter kept: asking for "one", "two", "one" drops and reloads them.
        options={"enforce_eager": True, "dtype": "float32", "max_num_seqs": 8,
                 "max_model_len": 1024, "enable_lora": True, "max_lora_rank": 8,
                 "max_loras": 1, "max_cpu_loras": 1},
    )
    eng = load_engine(spec)
    assert isinstance(eng, VllmEngine)
    yield eng
    eng.close()


def chat(request_id: str, model: str, question: str, adapter_path: str = "") -> EngineRequest:
    return EngineRequest(request_id, CHAT, {
        "model": model, "messages": [{"role": "user", "content": question}],
        "max_tokens": 16, "temperature": 0}, adapter_path=adapter_path)


def answers(engine: VllmEngine, requests: list[EngineRequest]) -> dict[str, str]:
    results = {r.request_id: r for r in engine.run(requests)}
    for result in results.values():
        assert result.status_code == 200, result.body
    return {rid: r.body["choices"][0]["message"]["content"] for rid, r in results.items()}


def test_an_adapter_changes_its_requests_and_not_the_base_models(
        engine: VllmEngine, adapters: dict[str, str]) -> None:
    questions = ["Name three colors.", "What is the capital of France?"]
    alone = answers(engine, [chat(f"base{i}", NAME, q) for i, q in enumerate(questions)])

    mixed = []
    for i, question in enumerate(questions):
        mixed += [chat(f"base{i}", NAME, question),
                  chat(f"one{i}", "lora-one", question, adapters["one"]),
                  chat(f"two{i}", "lora-two", question, adapters["two"])]
    together = answers(engine, mixed)
    for i in range(len(questions)):
        assert together[f"base{i}"] == alone[f"base{i}"]
        assert together[f"one{i}"] != together[f"base{i}"]
        assert together[f"two{i}"] not in (together[f"base{i}"], together[f"one{i}"])

    # With room for one adapter, "one" was dropped for "two" (or the other way round) and
    # is read again from its folder: the same answers as before.
    again = answers(engine, [chat("one0", "lora-one", questions[0], adapters["one"]),
                             chat("two0", "lora-two", questions[0], adapters["two"]),
                             chat("one1", "lora-one", questions[1], adapters["one"])])
    assert again == {key: together[key] for key in again}


def test_an_adapter_that_cannot_load_fails_only_its_requests(
        engine: VllmEngine, adapters: dict[str, str], tmp_path: Path) -> None:
    results = {r.request_id: r for r in engine.run([
        chat("missing", "lora-missing", "Hi", str(tmp_path / "nothing-here")),
        chat("empty", "lora-empty", "Hi", adapters["empty"]),
        chat("base", NAME, "Hi"),
    ])}
    assert results["base"].status_code == 200
    for rid in ("missing", "empty"):
        result = results[rid]
        assert 400 <= result.status_code < 600 and result.body["error"]["message"], result
    # Not remembered as loaded: asked for again, it is refused again, not run on the base.
    (retry,) = engine.run([chat("missing", "lora-missing", "Hi", str(tmp_path / "nope"))])
    assert retry.status_code >= 400
