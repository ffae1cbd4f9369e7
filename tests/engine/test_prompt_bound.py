"""The budget's input bound against the real engine: for a generated corpus of request shapes
on every chat face (tests/engine/prompt_shapes.py), vLLM's own `prompt_tokens` never
exceeds the bound the budget counts (`jobs.formats.prompts.prompt_bound`), with SmolLM2's own chat
template (a default system prompt when the first message is not one) and with a template
that renders tools, tool calls and tool results (tests/engine/templates/tools_chatml.jinja);
and without a tokenizer (one token per byte), the fallback still holds. On plain chat the
bound stays within 3x of what is used, so budgets still admit real work."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine import CHAT, MESSAGES, RESPONSES, EngineRequest, load_engine
from engine.catalog import DEFAULT_MODELS
from engine.endpoints import endpoint, usage_of
from engine.prepare import prepare_model
from engine.tokens import PromptCounter
from engine.vllm_engine import VllmEngine
from jobs.formats.prompts import Room, prompt_bound
from jobs.formats.wire import RequestLine
from tests.engine import needs_vllm
from tests.engine.prompt_shapes import corpus

pytestmark = [needs_vllm, pytest.mark.engine, pytest.mark.timeout(900)]

NAME = "smol"
CONTEXT = 2048
TOOLS_TEMPLATE = Path(__file__).parent / "templates" / "tools_chatml.jinja"
LIMIT_FIELD = {CHAT: "max_tokens", MESSAGES: "max_tokens", RESPONSES: "max_output_tokens"}


@pytest.fixture(scope="module", params=["own template", "tools template"])
def served(request: pytest.FixtureRequest, model_cache: Path) -> Iterator[tuple[VllmEngine, Room]]:
    base = DEFAULT_MODELS[0]
    # A tool call parser lets requests with tools (tool_choice auto) run at all.
    options: dict[str, Any] = {"dtype": "float32", "enforce_eager": True,
                               "max_model_len": CONTEXT, "max_num_seqs": 8,
                               "enable_auto_tool_choice": True, "tool_call_parser": "hermes"}
    if request.param == "tools template":
        options["chat_template"] = str(TOOLS_TEMPLATE)
    spec = base.__class__(name=NAME, backend="vllm", path=str(prepare_model(base, model_cache)),
                          options=options)
    engine = load_engine(spec)
    assert isinstance(engine, VllmEngine)
    room = Room(context=CONTEXT, cap=CONTEXT, counter=PromptCounter(spec),
                media_tokens=CONTEXT)
    yield engine, room
    engine.close()


def test_the_engine_never_counts_more_prompt_tokens_than_the_bound(served) -> None:
    engine, room = served
    cases = corpus(seed=68, count=90)
    requests = [EngineRequest(f"r{i}", url, {**body, "model": NAME, LIMIT_FIELD[url]: 16})
                for i, (url, body) in enumerate(cases)]
    results = {r.request_id: r for r in engine.run(requests)}
    ran = 0
    plain: list[float] = []
    for request in requests:
        result = results[request.request_id]
        line = RequestLine(request.request_id, request.url, request.body)
        bound = prompt_bound(line, room)
        if result.status_code != 200:
            # Only prompts past the model's context are refused (uncharged): their bound
            # is past it too.
            assert "maximum context length" in str(result.body), result.body
            assert bound > CONTEXT, (bound, request.body)
            continue
        ran += 1
        used = usage_of(request.url, result.body)[0]
        without_tokenizer = endpoint(request.url).prompt_bound(request.body)
        assert used <= bound, (request.url, used, bound, request.body)
        assert used <= without_tokenizer, (request.url, used, without_tokenizer)
        if request.url == CHAT and not request.body.get("tools"):
            plain.append(bound / used)
    assert ran >= 0.75 * len(requests)
    assert plain and max(plain) <= 3.0, plain
    print(f"\n{ran} of {len(requests)} ran; plain chat bound/used at most {max(plain):.2f}")
