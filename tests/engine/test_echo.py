"""The test-only echo engine: shapes, limits, streaming contract, abort."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator

import pytest

from engine import (
    CHAT,
    COMPLETIONS,
    EMBEDDINGS,
    RERANK,
    RESPONSES,
    SCORE,
    EngineError,
    EngineRequest,
    EngineResult,
    ModelSpec,
    load_engine,
)
from engine.echo import EchoEngine


def echo(**options: object) -> EchoEngine:
    engine = load_engine(ModelSpec(name="echo-test", backend="echo", options=dict(options)))
    assert isinstance(engine, EchoEngine)
    return engine


def chat(rid: str, text: str, **body: object) -> EngineRequest:
    return EngineRequest(
        rid, CHAT, {"model": "echo-test", "messages": [{"role": "user", "content": text}], **body}
    )


def run_all(engine: EchoEngine, requests: list[EngineRequest]) -> dict[str, EngineResult]:
    results = {r.request_id: r for r in engine.run(requests)}
    assert len(results) == len(requests)
    return results


def test_unknown_backend_is_an_engine_error() -> None:
    with pytest.raises(EngineError):
        load_engine(ModelSpec(name="x", backend="nope"))


def test_chat_shape_and_usage() -> None:
    body = {
        "model": "echo-test",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hello there"},
            {"role": "assistant", "content": "hi"},
            {"role": "user", "content": [{"type": "text", "text": "say it back"}]},
        ],
    }
    (result,) = echo().run([EngineRequest("r1", CHAT, body)])
    assert result.request_id == "r1" and result.status_code == 200 and not result.aborted
    out = result.body
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    assert out["model"] == "echo-test"
    (choice,) = out["choices"]
    assert choice["message"] == {
        "role": "assistant", "content": "echo: say it back", "refusal": None, "tool_calls": []
    }
    assert choice["finish_reason"] == "stop" and choice["index"] == 0
    # 2 + 2 + 1 + 3 words in all messages; output "echo: say it back" is 4 tokens.
    assert out["usage"]["prompt_tokens"] == 8
    assert out["usage"]["completion_tokens"] == 4
    assert out["usage"]["total_tokens"] == 12


def test_deterministic_content_and_unique_ids() -> None:
    engine = echo()
    a, b = engine.run([chat("a", "same words"), chat("b", "same words")])
    assert a.body["choices"] == b.body["choices"]
    assert a.body["id"] != b.body["id"]


@pytest.mark.parametrize("key", ["max_tokens", "max_completion_tokens"])
def test_truncation_to_max_tokens(key: str) -> None:
    (r,) = echo().run([chat("a", "one two three four", **{key: 3})])
    choice = r.body["choices"][0]
    assert choice["message"]["content"] == "echo: one two"
    assert choice["finish_reason"] == "length"
    assert r.body["usage"]["completion_tokens"] == 3


def test_n_choices() -> None:
    (r,) = echo().run([chat("a", "x y", n=3)])
    assert [c["index"] for c in r.body["choices"]] == [0, 1, 2]
    assert {c["message"]["content"] for c in r.body["choices"]} == {"echo: x y"}
    assert r.body["usage"]["completion_tokens"] == 9


def test_completion_echoes_prompt() -> None:
    body = {"model": "echo-test", "prompt": "a b c", "max_tokens": 2}
    req = EngineRequest("c", COMPLETIONS, body)
    (r,) = echo().run([req])
    assert r.status_code == 200
    assert r.body["object"] == "text_completion" and r.body["id"].startswith("cmpl-")
    assert r.body["choices"][0]["text"] == "a b"
    assert r.body["choices"][0]["finish_reason"] == "length"
    assert r.body["usage"] == {
        "prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2, "prompt_tokens_details": None
    }


def test_embeddings_deterministic_8_dim() -> None:
    body = {"model": "echo-test", "input": ["hello world", "other"]}
    (r1,) = echo().run([EngineRequest("e", EMBEDDINGS, body)])
    (r2,) = echo().run([EngineRequest("e", EMBEDDINGS, {**body, "input": "hello world"})])
    assert r1.status_code == 200 and r1.body["object"] == "list"
    assert r1.body["id"].startswith("embd-")
    first, second = r1.body["data"]
    assert first["object"] == "embedding" and first["index"] == 0 and second["index"] == 1
    assert len(first["embedding"]) == 8 and all(-1 <= v < 1 for v in first["embedding"])
    assert first["embedding"] != second["embedding"]
    assert r2.body["data"][0]["embedding"] == first["embedding"]
    assert r1.body["usage"]["prompt_tokens"] == 3 and r1.body["usage"]["total_tokens"] == 3


def test_score_is_the_cosine_of_the_echo_embeddings() -> None:
    engine = echo()
    texts = ["a cat", "a kitten", "taxes rose"]
    (embedded,) = engine.run([EngineRequest("e", EMBEDDINGS, {"model": "echo-test",
                                                              "input": texts})])
    cat, kitten, taxes = (d["embedding"] for d in embedded.body["data"])

    def cosine(a: list[float], b: list[float]) -> float:
        dot = sum(x * y for x, y in zip(a, b, strict=True))
        return dot / (sum(x * x for x in a) ** 0.5 * sum(y * y for y in b) ** 0.5)

    results = run_all(engine, [
        EngineRequest("1:N", SCORE, {"model": "echo-test", "queries": "a cat",
                                     "documents": ["a kitten", "taxes rose"]}),
        EngineRequest("N:N", SCORE, {"model": "echo-test", "text_1": ["a cat", "a kitten"],
                                     "text_2": [{"content": [{"type": "text",
                                                              "text": "a kitten"}]},
                                                "taxes rose"]}),
    ])
    one = results["1:N"].body
    assert results["1:N"].status_code == 200
    assert set(one) == {"id", "object", "created", "model", "data", "usage"}
    assert one["id"].startswith("score-") and one["object"] == "list"
    assert [(d["index"], d["object"]) for d in one["data"]] == [(0, "score"), (1, "score")]
    assert [d["score"] for d in one["data"]] == pytest.approx(
        [cosine(cat, kitten), cosine(cat, taxes)])
    # Each input's words once (the query is embedded once), as vLLM counts them.
    assert one["usage"] == {"prompt_tokens": 6, "total_tokens": 6, "completion_tokens": 0,
                            "prompt_tokens_details": None, "completion_tokens_details": None}
    pairs = results["N:N"].body["data"]
    assert [d["score"] for d in pairs] == pytest.approx(
        [cosine(cat, kitten), cosine(kitten, taxes)])


def test_rerank_orders_the_documents_by_relevance_and_keeps_top_n() -> None:
    documents = ["taxes rose", "a kitten", "dogs bark", {"content": [
        {"type": "text", "text": "a cat"}]}]
    body = {"model": "echo-test", "query": "a cat", "documents": documents}
    results = run_all(echo(), [EngineRequest("all", RERANK, body),
                               EngineRequest("top", RERANK, {**body, "top_n": 2})])
    ranked = results["all"].body
    assert set(ranked) == {"id", "model", "usage", "results"}
    assert ranked["id"].startswith("score-") and ranked["model"] == "echo-test"
    scores = [r["relevance_score"] for r in ranked["results"]]
    assert scores == sorted(scores, reverse=True) and len(scores) == 4
    # The same text scores 1 against itself: the multimodal-shaped document comes first.
    assert ranked["results"][0] == {"index": 3, "document": {
        "text": None, "multi_modal": documents[3]["content"]},
        "relevance_score": pytest.approx(1.0)}
    assert {r["index"]: r["document"] for r in ranked["results"]}[1] == {
        "text": "a kitten", "multi_modal": None}
    assert ranked["usage"] == {"prompt_tokens": 10, "total_tokens": 10}
    assert results["top"].body["results"] == ranked["results"][:2]


def test_a_score_input_over_the_context_is_400_like_vllm() -> None:
    (result,) = echo(max_model_len=3).run([EngineRequest(
        "s", RERANK, {"model": "echo-test", "query": "a", "documents": ["w " * 4]})])
    assert result.status_code == 400
    assert "maximum context length is 3 tokens" in result.body["error"]["message"]


def test_too_long_prompt_is_400_like_vllm() -> None:
    engine = echo(max_model_len=10)
    results = run_all(engine, [chat("long", "w " * 10, max_tokens=5), chat("ok", "short"),
                               chat("room", "w " * 8, max_tokens=5)])
    err = results["long"]
    assert err.status_code == 400
    assert set(err.body["error"]) == {"message", "type", "param", "code"}
    assert err.body["error"]["type"] == "BadRequestError" and err.body["error"]["code"] == 400
    assert "maximum context length is 10 tokens" in err.body["error"]["message"]
    assert results["ok"].status_code == 200
    # As vLLM: an output limit past what the prompt leaves is lowered to it.
    assert results["room"].body["usage"]["completion_tokens"] <= 2


def test_a_body_it_cannot_read_is_one_400() -> None:
    # Parameter checks (max_tokens, n, stream...) are validation's, for every engine alike
    # (its endpoint's `check`; the bad-input corpus has each): the echo engine keeps only the
    # model's own refusals, and a body it cannot read at all is a plain 400.
    reqs = [
        EngineRequest("m", CHAT, {"model": "echo-test"}),
        EngineRequest("p", COMPLETIONS, {"model": "echo-test"}),
        EngineRequest("e", EMBEDDINGS, {"model": "echo-test", "input": 3}),
        EngineRequest("u", "/v1/responses", {"model": "echo-test"}),
        EngineRequest("s", SCORE, {"model": "echo-test", "text_1": "a"}),
        EngineRequest("n", SCORE, {"model": "echo-test", "queries": ["a", "b"],
                                   "documents": ["c", "d", "e"]}),
    ]
    assert {r.status_code for r in echo().run(reqs)} == {400}


def test_lazy_pull_from_a_blocking_iterable() -> None:
    # Request k+1 is only handed in after result k came out: run() must pull lazily.
    for engine in (echo(), echo(seconds_per_request=0.01)):
        inbox: queue.Queue[EngineRequest | None] = queue.Queue()

        def source(inbox: queue.Queue[EngineRequest | None] = inbox) -> Iterator[EngineRequest]:
            while (item := inbox.get(timeout=5)) is not None:
                yield item

        inbox.put(chat("0", "first"))
        seen = []
        for result in engine.run(source()):
            seen.append(result.request_id)
            inbox.put(chat(str(len(seen)), "next") if len(seen) < 5 else None)
        assert seen == ["0", "1", "2", "3", "4"]


def test_slow_requests_respect_in_flight_bound_and_run_concurrently() -> None:
    engine = echo(seconds_per_request=0.05, max_in_flight=4)
    pulled = 0
    yielded = 0
    worst = 0

    def source() -> Iterator[EngineRequest]:
        nonlocal pulled, worst
        for i in range(20):
            pulled += 1
            worst = max(worst, pulled - yielded)
            yield chat(str(i), "x")

    start = time.monotonic()
    for _ in engine.run(source()):
        yielded += 1
    elapsed = time.monotonic() - start
    assert yielded == 20
    assert worst <= 4
    # 20 x 0.05 s serially would be 1 s; 4 at a time is ~0.25 s.
    assert elapsed < 0.8


def test_abort_in_flight_yields_aborted_results() -> None:
    engine = echo(seconds_per_request=2, max_in_flight=8)
    reqs = [chat(f"slow{i}", "x") for i in range(3)]
    results: list[EngineResult] = []
    timer = threading.Timer(0.2, engine.abort, args=(["slow0", "slow2", "not-there"],))
    timer.start()
    start = time.monotonic()
    for r in engine.run(reqs):
        results.append(r)
    by_id = {r.request_id: r for r in results}
    assert len(results) == 3
    assert by_id["slow0"].aborted and by_id["slow2"].aborted and by_id["slow0"].body == {}
    assert not by_id["slow1"].aborted and by_id["slow1"].status_code == 200
    # The aborted ones came back right away, not after their 2 s.
    assert [r.request_id for r in results][-1] == "slow1"
    assert time.monotonic() - start < 2.9


def test_iterable_error_propagates() -> None:
    def source() -> Iterator[EngineRequest]:
        yield chat("a", "x")
        raise RuntimeError("input broke")

    for engine in (echo(), echo(seconds_per_request=0.01)):
        with pytest.raises(RuntimeError, match="input broke"):
            list(engine.run(source()))


def test_closed_engine_refuses_to_run() -> None:
    engine = echo()
    engine.close()
    with pytest.raises(EngineError):
        list(engine.run([chat("a", "x")]))


def test_throughput_is_cheap() -> None:
    # Used to benchmark orchestration on 1M requests: the engine must stay far from the
    # bottleneck (tens of microseconds per request).
    n = 20_000
    reqs = (chat(str(i), "a few words of text", max_tokens=3) for i in range(n))
    start = time.perf_counter()
    count = sum(1 for _ in echo().run(reqs))
    per_request = (time.perf_counter() - start) / n
    assert count == n
    assert per_request < 200e-6, per_request


def test_responses_shape_and_usage() -> None:
    body = {"model": "echo-test", "instructions": "be brief", "input": [
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "hi"}]},
        {"role": "user", "content": [{"type": "input_text", "text": "say it back"}]}]}
    (result,) = echo().run([EngineRequest("r1", RESPONSES, body)])
    assert result.status_code == 200, result.body
    out = result.body
    assert out["object"] == "response" and out["id"].startswith("resp_")
    assert (out["model"], out["status"], out["incomplete_details"]) == (
        "echo-test", "completed", None)
    (message,) = out["output"]
    assert (message["type"], message["role"]) == ("message", "assistant")
    assert [(p["type"], p["text"]) for p in message["content"]] == [
        ("output_text", "echo: say it back")]
    # 2 + 2 + 1 + 3 words of instructions and messages; 4 words out.
    assert out["usage"] == {"input_tokens": 8, "output_tokens": 4, "total_tokens": 12,
                            "input_tokens_details": {"cached_tokens": 0},
                            "output_tokens_details": {"reasoning_tokens": 0}}


def test_a_response_cut_at_max_output_tokens_is_incomplete() -> None:
    body = {"model": "echo-test", "input": "one two three four", "max_output_tokens": 3}
    (r,) = echo().run([EngineRequest("a", RESPONSES, body)])
    assert r.body["status"] == "incomplete"
    assert r.body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert r.body["output"][0]["content"][0]["text"] == "echo: one two"
    assert r.body["usage"]["output_tokens"] == 3
