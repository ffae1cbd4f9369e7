"""The remote engine against a real `vllm serve` of all-MiniLM-L6-v2 (runner pooling):
embeddings, score and rerank answered as the server writes them, with the batch priority."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.base import EngineRequest, ModelSpec
from engine.endpoints import EMBEDDINGS, RERANK, SCORE
from engine.remote import RemoteEngine
from tests.engine import needs_vllm
from tests.faultproxy import FaultProxy
from tests.vllmserve import VllmServe

pytestmark = [needs_vllm, pytest.mark.engine, pytest.mark.timeout(600)]

NAME = "minilm-remote"


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RemoteEngine, FaultProxy]]:
    log: Path = tmp_path_factory.mktemp("vllm") / "serve.log"
    server = VllmServe("all-MiniLM-L6-v2", "minilm", "--runner", "pooling", "--dtype",
                       "float32", "--max-num-seqs", "8", "--scheduling-policy", "priority",
                       log=log)
    proxy = FaultProxy(f"http://127.0.0.1:{server.port}")
    try:
        server.wait_ready()
        remote = RemoteEngine(ModelSpec(name=NAME, backend="remote", options={
            "base_url": proxy.url, "model": "minilm",
            "redis_url": os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")}))
        yield remote, proxy
        remote.close()
    finally:
        proxy.close()
        server.stop()


def test_embeddings_score_and_rerank(engine) -> None:
    remote, proxy = engine
    proxy.faults.append(("status", 429, 0))
    results = {r.request_id: r for r in remote.run([
        EngineRequest("e", EMBEDDINGS, {"model": NAME, "input": ["A dog.", "A cat."]}),
        EngineRequest("s", SCORE, {"model": NAME, "queries": "A cat.",
                                   "documents": ["A cat.", "Tax law."]}),
        EngineRequest("r", RERANK, {"model": NAME, "query": "A cat.",
                                    "documents": ["Tax law.", "A kitten."]}),
    ])}
    assert {k: r.status_code for k, r in results.items()} == {"e": 200, "s": 200, "r": 200}
    vectors = [item["embedding"] for item in results["e"].body["data"]]
    assert len(vectors) == 2 and len(vectors[0]) == 384
    assert math.isclose(sum(x * x for x in vectors[0]), 1.0, rel_tol=1e-3)
    scores = [item["score"] for item in results["s"].body["data"]]
    assert scores[0] > scores[1]
    assert results["r"].body["results"][0]["index"] == 1  # the kitten first
    assert results["e"].body["usage"]["prompt_tokens"] > 0
    assert {b.get("priority") for b in proxy.bodies} == {10}
    # Three requests and the retry of the one the injected 429 hit.
    assert len(proxy.posts) == 4
    assert set(proxy.posts) == {"/v1/embeddings", "/v1/score", "/v1/rerank"}
