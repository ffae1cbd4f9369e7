"""The real vLLM engine on SmolLM2-135M-Instruct (CPU). One engine for the whole module.

float32 so that greedy output does not depend on how requests were batched; enforce_eager
to skip minutes of compilation. Requests are kept short: the module runs in ~1-2 minutes.
"""

from __future__ import annotations

import json
import queue
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine import (
    CHAT,
    COMPLETIONS,
    EMBEDDINGS,
    MESSAGES,
    RESPONSES,
    EngineRequest,
    EngineResult,
    load_engine,
)
from engine.catalog import DEFAULT_MODELS
from engine.endpoints import REGISTRY, usage_of
from engine.endpoints.responses import output_text as response_output_text
from engine.prefix_limit import PrefixLimit
from engine.prepare import prepare_model
from engine.vllm_engine import VllmEngine
from jobs.policy.quality import flags_for
from tests.engine import needs_vllm

pytestmark = [needs_vllm, pytest.mark.engine, pytest.mark.timeout(600)]

NAME = "smol"
MAX_MODEL_LEN = 512
MAX_NUM_SEQS = 4


@pytest.fixture(scope="module")
def engine(model_cache: Path) -> Iterator[VllmEngine]:
    base = DEFAULT_MODELS[0]
    path = prepare_model(base, model_cache)
    spec = base.__class__(
        name=NAME,
        backend="vllm",
        path=str(path),
        options={
            "dtype": "float32",
            "enforce_eager": True,
            "max_model_len": MAX_MODEL_LEN,
            "max_num_seqs": MAX_NUM_SEQS,
        },
    )
    eng = load_engine(spec)
    assert isinstance(eng, VllmEngine)
    yield eng
    eng.close()


# A JSON Schema the structured-output tests ask for.
PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def chat(rid: str, text: str, **body: Any) -> EngineRequest:
    return EngineRequest(
        rid, CHAT, {"model": NAME, "messages": [{"role": "user", "content": text}], **body}
    )


def run_all(engine: VllmEngine, requests: list[EngineRequest]) -> dict[str, EngineResult]:
    results = {r.request_id: r for r in engine.run(requests)}
    assert sorted(results) == sorted(r.request_id for r in requests)
    return results


def content(result: EngineResult, i: int = 0) -> str:
    assert result.status_code == 200, result.body
    return result.body["choices"][i]["message"]["content"]


def test_chat_shape_and_usage(engine: VllmEngine) -> None:
    r = run_all(engine, [chat("a", "What is 2+2?", max_tokens=12, temperature=0)])["a"]
    assert r.status_code == 200 and not r.aborted
    body = r.body
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == NAME
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
    assert choice["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert usage["prompt_tokens"] > 5 and 0 < usage["completion_tokens"] <= 12
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    json.dumps(body)  # the worker writes it as a JSON line


def test_completions(engine: VllmEngine) -> None:
    req = EngineRequest(
        "c",
        COMPLETIONS,
        {"model": NAME, "prompt": "The capital of France is", "max_tokens": 5, "temperature": 0},
    )
    body = run_all(engine, [req])["c"].body
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"][0]["text"]
    assert body["usage"]["completion_tokens"] == 5
    assert body["choices"][0]["finish_reason"] == "length"


def test_n_seed_logprobs(engine: VllmEngine) -> None:
    sampled = {"temperature": 1.0, "max_tokens": 10, "seed": 1234}
    results = run_all(
        engine,
        [
            chat("n2", "Tell me a story.", n=2, max_tokens=8, temperature=1.0),
            chat("seed1", "Name a colour.", **sampled),
            chat("seed2", "Name a colour.", **sampled),
            chat("lp", "Hi", logprobs=True, top_logprobs=2, max_tokens=3, temperature=0),
        ],
    )
    n2 = results["n2"].body
    assert [c["index"] for c in n2["choices"]] == [0, 1]
    assert n2["usage"]["completion_tokens"] <= 16

    assert content(results["seed1"]) == content(results["seed2"])

    lp = results["lp"].body["choices"][0]["logprobs"]["content"]
    assert len(lp) == results["lp"].body["usage"]["completion_tokens"]
    assert all(len(tok["top_logprobs"]) == 2 and tok["logprob"] <= 0 for tok in lp)


def test_stop(engine: VllmEngine) -> None:
    # Take a word from the greedy answer, then ask again stopping at it: the answer must
    # end right before it. (Robust to whatever this small model happens to say.)
    ask = {"temperature": 0, "max_tokens": 12}
    full = content(run_all(engine, [chat("full", "Describe the sea.", **ask)])["full"])
    word = full.split()[3]
    r = run_all(engine, [chat("stop", "Describe the sea.", stop=[word], **ask)])["stop"]
    choice = r.body["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == word
    assert full.startswith(choice["message"]["content"])
    assert word not in choice["message"]["content"]


def test_json_schema_response_format(engine: VllmEngine) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = PERSON_SCHEMA
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    results = run_all(
        engine,
        [
            chat("js", "Describe a person as JSON.", response_format=fmt, max_tokens=60,
                 temperature=0),
            chat("jo", "Give me a JSON object.", response_format={"type": "json_object"},
                 max_tokens=40, temperature=0),
        ],
    )
    jsonschema.validate(json.loads(content(results["js"])), schema)
    assert results["jo"].status_code == 200


def test_too_long_prompt_and_bad_params_are_400_while_others_succeed(
    engine: VllmEngine,
) -> None:
    results = run_all(
        engine,
        [
            chat("ok1", "Hello", max_tokens=4),
            chat("long", "hello " * (MAX_MODEL_LEN + 10), max_tokens=4),
            chat("neg", "Hello", max_tokens=-1),
            chat("temp", "Hello", temperature="hot"),
            chat("stream", "Hello", stream=True),
            EngineRequest("nomsg", CHAT, {"model": NAME}),
            EngineRequest("embed", EMBEDDINGS, {"model": NAME, "input": "x"}),
            chat("ok2", "Bye", max_tokens=4),
        ],
    )
    assert results["ok1"].status_code == 200 and results["ok2"].status_code == 200
    for rid in ("long", "neg", "temp", "stream", "nomsg", "embed"):
        r = results[rid]
        assert r.status_code == 400, (rid, r.body)
        err = r.body["error"]
        assert err["code"] == 400 and err["type"] == "BadRequestError" and err["message"]
    assert "maximum context length" in results["long"].body["error"]["message"]
    assert results["neg"].body["error"]["param"] == "max_tokens"



def test_anthropic_messages_shape_and_usage(engine: VllmEngine) -> None:
    """A /v1/messages request runs through vLLM's Anthropic layer: an Anthropic Message
    with its usage, the same greedy answer as the chat request it renders to, and errors
    in Anthropic's shape."""
    system = "You are terse."
    question = "What is 2+2?"
    results = run_all(engine, [
        EngineRequest("m", MESSAGES, {
            "model": NAME, "max_tokens": 12, "temperature": 0, "system": system,
            "messages": [{"role": "user", "content": [{"type": "text", "text": question}]}]}),
        chat("c", question, max_tokens=12, temperature=0,
             messages=[{"role": "system", "content": system},
                       {"role": "user", "content": question}]),
        EngineRequest("long", MESSAGES, {
            "model": NAME, "max_tokens": 4,
            "messages": [{"role": "user", "content": "hello " * (MAX_MODEL_LEN + 10)}]}),
    ])
    r = results["m"]
    assert r.status_code == 200, r.body
    body = r.body
    assert body["type"] == "message" and body["role"] == "assistant"
    assert body["model"] == NAME and body["id"]
    (block,) = body["content"]
    assert block["type"] == "text" and block["text"] == content(results["c"])
    assert body["stop_reason"] in ("end_turn", "max_tokens")
    usage = body["usage"]
    assert 0 < usage["output_tokens"] <= 12
    assert usage["output_tokens"] == results["c"].body["usage"]["completion_tokens"]
    # Anthropic counts prompt tokens served from the prefix cache apart; ours sum them.
    prompt, completion, cached = usage_of(MESSAGES, body)
    assert prompt == results["c"].body["usage"]["prompt_tokens"]
    assert (completion, cached) == (usage["output_tokens"],
                                    usage.get("cache_read_input_tokens", 0))
    anthropic_types = pytest.importorskip("anthropic.types")
    anthropic_types.Message.model_validate(body)  # the client's own type
    json.dumps(body)

    long = results["long"]
    assert long.status_code == 400
    assert long.body["type"] == "error"
    assert long.body["error"]["type"] == "invalid_request_error"
    assert "context" in long.body["error"]["message"]


def test_parameters_vllm_would_silently_ignore_are_400(engine: VllmEngine) -> None:
    """OpenAI parameters that change the answer and that vLLM's request models do not know
    would run as if unset: each is a 400 naming it. Set to what running without them
    gives anyway, or when they do not change the answer, the request runs."""
    function = {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}

    def completion(rid: str, **body: Any) -> EngineRequest:
        return EngineRequest(rid, COMPLETIONS, {"model": NAME, "prompt": "The sky is",
                                                "max_tokens": 2, "temperature": 0, **body})

    refused = {
        "functions": chat("functions", "Weather in Paris?", functions=[function]),
        "function_call": chat("function_call", "Weather?", function_call="auto"),
        "modalities": chat("modalities", "Hi", modalities=["text", "audio"],
                           audio={"voice": "alloy", "format": "wav"}),
        "audio": chat("audio", "Hi", audio={"voice": "alloy", "format": "wav"}),
        "web_search_options": chat("web_search_options", "News?", web_search_options={}),
        "best_of": completion("best_of", best_of=3),
    }
    allowed = [
        chat("text-only", "Hi", max_tokens=2, modalities=["text"], function_call="none",
             functions=[], metadata={"team": "a"}, store=False, service_tier="auto",
             prediction={"type": "content", "content": "Hello"}, user="u1"),
        completion("best-of-n", best_of=2, n=2, temperature=0.8, seed=1),
        chat("penalties", "Hi", max_tokens=2, presence_penalty=-1.5,
             frequency_penalty=1.0, logit_bias={"2": -100}),
    ]
    results = run_all(engine, [*refused.values(), *allowed])
    for rid in refused:
        r = results[rid]
        assert r.status_code == 400, (rid, r.body)
        error = r.body["error"]
        assert error["type"] == "BadRequestError" and error["param"] == rid, error
        assert "not supported" in error["message"]
    for req in allowed:
        assert results[req.request_id].status_code == 200, results[req.request_id].body
    assert len(results["best-of-n"].body["choices"]) == 2

def test_abort(engine: VllmEngine) -> None:
    # "long" would generate 400 tokens (~10 s here); abort it once the quick one is back.
    reqs = [
        chat("long", "Write a long essay.", max_tokens=400, ignore_eos=True),
        chat("quick", "Hi", max_tokens=2),
    ]
    seen: list[EngineResult] = []
    for r in engine.run(reqs):
        seen.append(r)
        if r.request_id == "quick":
            engine.abort(["long", "unknown-id"])
    by_id = {r.request_id: r for r in seen}
    assert len(seen) == 2
    assert by_id["quick"].status_code == 200 and not by_id["quick"].aborted
    assert by_id["long"].aborted and by_id["long"].body == {}
    # Still usable afterwards.
    assert run_all(engine, [chat("after", "Hi", max_tokens=2)])["after"].status_code == 200


def test_in_flight_bound_and_lazy_blocking_pull(engine: VllmEngine) -> None:
    assert engine.max_in_flight == 2 * MAX_NUM_SEQS
    pulled = yielded = worst = 0

    def source() -> Iterator[EngineRequest]:
        nonlocal pulled, worst
        for i in range(3 * engine.max_in_flight):
            pulled += 1
            worst = max(worst, pulled - yielded)
            yield chat(str(i), "Hi", max_tokens=2)

    for _ in engine.run(source()):
        yielded += 1
    assert yielded == 3 * engine.max_in_flight
    assert worst == engine.max_in_flight  # filled up to the bound, never past it

    # A blocking iterable fed by the consumer itself: it must be pulled off the event loop.
    inbox: queue.Queue[EngineRequest | None] = queue.Queue()
    inbox.put(chat("0", "Hi", max_tokens=2))

    def blocking() -> Iterator[EngineRequest]:
        while (item := inbox.get(timeout=60)) is not None:
            yield item

    order = []
    for r in engine.run(blocking()):
        order.append(r.request_id)
        inbox.put(chat(str(len(order)), "Hi", max_tokens=2) if len(order) < 3 else None)
    assert order == ["0", "1", "2"]


def test_greedy_output_is_stable_across_runs(engine: VllmEngine) -> None:
    prompts = ["What is the sun?", "Name three fruits.", "Say hello in French.", "Why?"]

    def once(extra: list[EngineRequest]) -> dict[str, str]:
        reqs = [chat(str(i), p, max_tokens=16, temperature=0) for i, p in enumerate(prompts)]
        results = run_all(engine, extra + reqs[::-1] if extra else reqs)
        return {rid: content(r) for rid, r in results.items() if not rid.startswith("x")}

    first = once([])
    # Other requests in the batch and another order: float32 greedy output must not change.
    second = once([chat("x1", "Tell me a joke.", max_tokens=20, temperature=0)])
    assert first == second



def _shared_prefix_requests(tag: str) -> list[EngineRequest]:
    """Two groups of three requests, each group with its own ~440-token system prompt."""
    requests = []
    for group in ("g1", "g2"):
        system = " ".join(f"{tag}-{group} rule {i}: answer briefly and politely."
                          for i in range(30))
        for item in range(3):
            requests.append(EngineRequest(
                f"{tag}-{group}-{item}", CHAT,
                {"model": NAME, "max_tokens": 4, "temperature": 0, "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": f"Item {item}: is the sky blue?"}]}))
    return requests


def test_requests_fed_by_prefix_group_compute_the_prefix_once(engine: VllmEngine) -> None:
    """What a batch grouped by prompt prefix relies on: fed next to each other, a group's
    requests after the first find the shared prefix in vLLM's prefix cache (even those
    scheduled in the same step), and usage says so as OpenAI does."""
    def cached(result: EngineResult) -> int:
        return result.body["usage"]["prompt_tokens_details"]["cached_tokens"]

    first = run_all(engine, _shared_prefix_requests("fresh"))
    for group in ("g1", "g2"):
        leader = first[f"fresh-{group}-0"]
        prompt = leader.body["usage"]["prompt_tokens"]
        assert cached(leader) < prompt // 2
        for item in (1, 2):
            follower = first[f"fresh-{group}-{item}"]
            # The shared system prompt, in whole cache blocks (128 tokens on CPU).
            assert cached(follower) > prompt // 2, follower.body["usage"]
    # Served from the cache, the answers are those computed from scratch.
    again = run_all(engine, _shared_prefix_requests("fresh"))
    assert all(cached(r) > 0 for r in again.values())
    assert {rid: content(r) for rid, r in again.items()} == {
        rid: content(r) for rid, r in first.items()}


def test_a_prefix_group_computes_its_shared_prefix_once(engine: VllmEngine) -> None:
    """Requests handed in with their prefix group's key (as a grouped shard's are): the
    group's first computes the shared prefix before the others are scheduled, and each of
    those finds all of it in the cache: the prompt tokens served from the cache are
    exactly the limit counted from the prompt blocks the engine reports (every distinct
    full block computed once), request by request."""
    requests = []
    for group in range(3):
        system = " ".join(f"limit-{group} rule {i}: answer briefly and politely."
                          for i in range(30))
        for item in range(3):
            requests.append(EngineRequest(
                f"limit-{group}-{item}", CHAT,
                {"model": NAME, "max_tokens": 4, "temperature": 0, "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": f"Item {item}: is the sky blue?"}]},
                cache_salt="limit-test", prefix=1000 + group))
    results = run_all(engine, requests)
    limit = PrefixLimit()
    for request in requests:  # in the order they were handed in
        result = results[request.request_id]
        usage = result.body["usage"]
        assert result.prompt_blocks is not None
        assert result.prompt_blocks.block_size == engine.prefix_block_size
        assert len(result.prompt_blocks.keys) == (usage["prompt_tokens"] - 1) // (
            engine.prefix_block_size)
        cacheable = limit.add(usage["prompt_tokens"], result.prompt_blocks)
        assert usage["prompt_tokens_details"]["cached_tokens"] == cacheable, request.request_id
    assert limit.cacheable >= 6 * 3 * engine.prefix_block_size  # the prefixes: 3+ blocks


def test_the_prefix_cache_is_shared_only_under_one_salt(engine: VllmEngine) -> None:
    """Requests of different owners (salts) never find each other's prompts in the prefix
    cache, so `cached_tokens` tells no user how another's prompts begin; one owner's
    requests still do. Every endpoint of a chat model takes the salt."""
    system = " ".join(f"salted rule {i}: answer briefly and politely." for i in range(30))
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": "Is the sky blue?"}]

    def ask(rid: str, salt: str) -> dict[str, Any]:
        (result,) = run_all(engine, [EngineRequest(
            rid, CHAT, {"model": NAME, "max_tokens": 2, "temperature": 0,
                        "messages": messages}, cache_salt=salt)]).values()
        assert result.status_code == 200, result.body
        return result.body["usage"]

    first = ask("owner-a-1", "owner-a")
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    for rid, salt in (("owner-b", "owner-b"), ("unsalted", "")):
        assert ask(rid, salt)["prompt_tokens_details"]["cached_tokens"] == 0, rid
    again = ask("owner-a-2", "owner-a")
    assert again["prompt_tokens_details"]["cached_tokens"] > first["prompt_tokens"] // 2

    results = run_all(engine, [
        EngineRequest("completion", COMPLETIONS, {"model": NAME, "prompt": "Hi",
                                                  "max_tokens": 2}, cache_salt="owner-a"),
        EngineRequest("response", RESPONSES, {"model": NAME, "input": "Hi",
                                              "max_output_tokens": 2}, cache_salt="owner-a"),
        EngineRequest("message", MESSAGES, {"model": NAME, "max_tokens": 2, "messages": [
            {"role": "user", "content": "Hi"}]}, cache_salt="owner-a")])
    for rid, result in results.items():
        assert result.status_code == 200, (rid, result.body)
        assert "owner-a" not in json.dumps(result.body), rid


def responses(rid: str, words: str, **body: Any) -> EngineRequest:
    return EngineRequest(rid, RESPONSES, {"model": NAME, "input": words, **body})


def output_text(result: EngineResult) -> str:
    assert result.status_code == 200, result.body
    return response_output_text(result.body)


def test_documented_responses_fields_are_fields_of_vllms_request() -> None:
    """What validation passes reaches vLLM's ResponsesRequest as a field it reads; the
    few OpenAI parameters it lacks do not change the answer (validation refuses
    `conversation`). A vLLM that adds or drops one makes this fail, to be looked at."""
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    missing = REGISTRY[RESPONSES].fields - set(ResponsesRequest.model_fields)
    assert missing == {"conversation", "prompt_cache_retention", "safety_identifier",
                       "stream_options"}


def test_responses_shape_usage_and_json_formats(engine: VllmEngine) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = PERSON_SCHEMA
    schema_format = {"format": {"type": "json_schema", "name": "person", "schema": schema}}
    function = {"type": "function", "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
    results = run_all(engine, [
        responses("plain", "What is 2+2?", instructions="Answer briefly.",
                  max_output_tokens=12, temperature=0),
        responses("items", "", input=[{"role": "user", "content": [
            {"type": "input_text", "text": "Count to ten."}]}],
            max_output_tokens=3, temperature=0, ignore_eos=True),
        responses("js", "Describe a person as JSON.", text=schema_format,
                  max_output_tokens=60, temperature=0),
        responses("jo", "Give me a JSON object.", text={"format": {"type": "json_object"}},
                  max_output_tokens=40, temperature=0),
        responses("tools", "Weather in Paris?", tools=[function]),
        responses("tools-none", "Hi", tools=[function], tool_choice="none",
                  max_output_tokens=2),
        responses("long", "hello " * (MAX_MODEL_LEN + 10), max_output_tokens=4),
    ])
    body = results["plain"].body
    assert results["plain"].status_code == 200, body
    assert body["object"] == "response" and body["id"].startswith("resp_")
    assert body["model"] == NAME and body["status"] in ("completed", "incomplete")
    (message,) = body["output"]
    assert (message["type"], message["role"]) == ("message", "assistant")
    assert message["content"][0]["type"] == "output_text" and output_text(results["plain"])
    assert body["instructions"] == "Answer briefly."
    usage = body["usage"]
    assert usage["input_tokens"] > 5 and 0 < usage["output_tokens"] <= 12
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert usage_of(RESPONSES, body) == (usage["input_tokens"], usage["output_tokens"],
                              usage["input_tokens_details"]["cached_tokens"])
    json.dumps(body)  # the worker writes it as a JSON line

    cut = results["items"].body
    assert (cut["status"], cut["incomplete_details"]) == (
        "incomplete", {"reason": "max_output_tokens"})
    assert cut["usage"]["output_tokens"] == 3
    assert flags_for(RESPONSES, {}, cut) == ["length_limit"]

    # Structured output honoured, and the format echoed back as OpenAI spells it.
    jsonschema.validate(json.loads(output_text(results["js"])), schema)
    assert results["js"].body["text"]["format"]["schema"] == schema
    assert results["jo"].status_code == 200, results["jo"].body

    # Function tools on a model without a tool call parser: refused, naming the field;
    # offered with tool_choice "none" they are never called, so the request runs.
    refused = results["tools"]
    assert refused.status_code == 400 and refused.body["error"]["param"] == "tools"
    assert "tool call parser" in refused.body["error"]["message"]
    assert results["tools-none"].status_code == 200, results["tools-none"].body

    long = results["long"]
    assert long.status_code == 400 and long.body["error"]["type"] == "BadRequestError"
