"""The real vLLM engine as an embedding model: all-MiniLM-L6-v2 with runner="pooling"."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make engine)")

from engine import CHAT, EMBEDDINGS, EngineRequest, ModelSpec, load_engine  # noqa: E402
from engine.prepare import DEFAULT_MODELS, prepare_model  # noqa: E402
from engine.vllm_engine import VllmEngine  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

NAME = "minilm"


@pytest.fixture(scope="module")
def engine(model_cache: Path) -> Iterator[VllmEngine]:
    base = next(s for s in DEFAULT_MODELS if EMBEDDINGS in s.endpoints)
    path = prepare_model(base, model_cache)
    spec = ModelSpec(
        name=NAME,
        backend="vllm",
        path=str(path),
        endpoints=(EMBEDDINGS,),
        options={"runner": "pooling", "enforce_eager": True, "dtype": "float32",
                 "max_num_seqs": 8},
    )
    eng = load_engine(spec)
    assert isinstance(eng, VllmEngine)
    yield eng
    eng.close()


def test_embeddings(engine: VllmEngine) -> None:
    reqs = [
        EngineRequest("one", EMBEDDINGS, {"model": NAME, "input": "The cat sat on the mat."}),
        EngineRequest("two", EMBEDDINGS, {"model": NAME, "input": ["A dog.", "A cat.", "Tax."]}),
        EngineRequest("chat", CHAT, {"model": NAME, "messages": [{"role": "user", "content": ""}]}),
        EngineRequest("bad", EMBEDDINGS, {"model": NAME, "input": "x", "encoding_format": "nope"}),
    ]
    results = {r.request_id: r for r in engine.run(reqs)}
    one = results["one"]
    assert one.status_code == 200, one.body
    assert one.body["object"] == "list" and one.body["id"].startswith("embd-")
    (item,) = one.body["data"]
    assert item["object"] == "embedding" and len(item["embedding"]) == 384
    # all-MiniLM-L6-v2 normalizes its embeddings.
    assert math.isclose(math.fsum(v * v for v in item["embedding"]), 1.0, rel_tol=1e-3)
    assert one.body["usage"]["prompt_tokens"] > 5
    assert one.body["usage"]["total_tokens"] == one.body["usage"]["prompt_tokens"]

    two = results["two"].body
    dog, cat, tax = (d["embedding"] for d in two["data"])
    assert [d["index"] for d in two["data"]] == [0, 1, 2]

    def cos(a: list[float], b: list[float]) -> float:
        return sum(x * y for x, y in zip(a, b, strict=True))

    assert cos(dog, cat) > cos(dog, tax)

    for rid in ("chat", "bad"):
        assert results[rid].status_code == 400, results[rid].body
        assert results[rid].body["error"]["code"] == 400
