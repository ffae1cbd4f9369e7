"""Prompt token counts with the models' own tokenizers (engine/tokens.py): exact where it
matters, a cheap bound elsewhere. Uses the prepared models' tokenizers, no engine."""

from __future__ import annotations

import random

import pytest

from engine.endpoints import (
    CHAT,
    COMPLETIONS,
    EMBEDDINGS,
    MESSAGES,
    RERANK,
    RESPONSES,
    SCORE,
    request_messages,
)
from engine.tokens import PromptCounter
from jobs.lib.model_registry import model_spec

pytestmark = pytest.mark.models

SAMPLES = [
    "word " * 40,
    "こんにちは世界、今日はいい天気ですね。" * 6,
    '{"id": 17, "tags": ["a", "b"], "nested": {"x": [1, 2, 3]}}' * 3,
    "Ünïcödé naïve café — “quotes” and emoji 🎉🚀 " * 5,
    "def f(x):\n    return x ** 2  # code\n" * 4,
    " \n\t  " * 10,
    "",
]


@pytest.fixture(scope="module")
def chat_counter() -> PromptCounter:
    return PromptCounter(model_spec("SmolLM2-135M-Instruct"))


@pytest.fixture(scope="module")
def embed_counter() -> PromptCounter:
    return PromptCounter(model_spec("all-MiniLM-L6-v2"))


def chat_body(*messages: tuple[str, str]) -> dict:
    return {"messages": [{"role": role, "content": text} for role, text in messages]}


def assert_over_agrees(counter: PromptCounter, url: str, body: dict) -> int:
    """`over` says "over" exactly when the count is over the limit, for limits on both
    sides of the count: the bound that spares the tokenizer is never below the count, nor
    is the looser one that clears whole chunks from the cost preview's estimate."""
    from jobs.formats.prompts import estimate_tokens
    from jobs.formats.wire import RequestLine

    count = counter.count(url, body)
    estimate = estimate_tokens(RequestLine("x", url, body))
    assert counter.bound(estimate, len(request_messages(url, body))) >= count
    for limit in (0, count - 1, count, count + 1, 10 * count + 100):
        assert counter.over(url, body, limit) == (count if count > limit else None), limit
    return count


def test_chat_counts_include_the_template_and_the_bound_never_undercounts(chat_counter):
    rng = random.Random(3)
    for text in SAMPLES:
        assert_over_agrees(chat_counter, CHAT, chat_body(("user", text)))
    for _ in range(40):
        roles = rng.choice([["user"], ["system", "user"], ["user", "assistant", "user"]])
        body = chat_body(*[(role, rng.choice(SAMPLES)[: rng.randrange(200)])
                           for role in roles])
        assert_over_agrees(chat_counter, CHAT, body)
    # The template's own tokens count: an empty message is not an empty prompt.
    assert chat_counter.count(CHAT, chat_body(("user", ""))) > 10
    # Scripts differ: Japanese takes several times the tokens of English of its length.
    english = chat_counter.count(CHAT, chat_body(("user", "word " * 24)))
    japanese = chat_counter.count(CHAT, chat_body(("user", "こんにちは世界" * 17)))
    assert japanese > 2 * english


def test_text_parts_are_counted_like_a_string(chat_counter):
    parts = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "first part"}, {"type": "text", "text": "second part"}]}]}
    assert chat_counter.count(CHAT, parts) == chat_counter.count(
        CHAT, chat_body(("user", "first part\nsecond part")))


def test_a_messages_body_counts_as_its_chat_rendering(chat_counter):
    # vLLM's Anthropic layer renders `system` as the first (system) message.
    body = {"system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi there"}]}]}
    count = assert_over_agrees(chat_counter, MESSAGES, body)
    assert count == chat_counter.count(CHAT, chat_body(("system", "Be brief."),
                                                       ("user", "hi there")))


def test_completions_and_embeddings_prompts(chat_counter, embed_counter):
    assert_over_agrees(chat_counter, COMPLETIONS, {"prompt": SAMPLES[1]})
    assert chat_counter.count(COMPLETIONS, {"prompt": [1, 2, 3, 4]}) == 4  # token ids
    # Several inputs: the largest decides.
    inputs = {"input": ["short", SAMPLES[0], SAMPLES[2]]}
    largest = max(embed_counter.count(EMBEDDINGS, {"input": text}) for text in inputs["input"])
    assert embed_counter.count(EMBEDDINGS, inputs) == largest
    assert_over_agrees(embed_counter, EMBEDDINGS, inputs)
    # WordPiece adds [CLS] and [SEP].
    assert embed_counter.count(EMBEDDINGS, {"input": "hello"}) == 3


def test_score_and_rerank_count_their_largest_input(embed_counter):
    # An embeddings model embeds each input of both sides on its own: the largest decides.
    def tokens(text: str) -> int:
        return embed_counter.count(EMBEDDINGS, {"input": text})

    score = {"queries": "short", "documents": [SAMPLES[0], {"content": [
        {"type": "text", "text": SAMPLES[2]}]}]}
    assert embed_counter.count(SCORE, score) == max(tokens(SAMPLES[0]), tokens(SAMPLES[2]))
    assert_over_agrees(embed_counter, SCORE, score)
    rerank = {"query": SAMPLES[3], "documents": ["a cat", "a dog"]}
    assert embed_counter.count(RERANK, rerank) == tokens(SAMPLES[3])
    assert_over_agrees(embed_counter, RERANK, rerank)


def test_the_prompt_size_rule_counts_the_models_tokens(chat_counter):
    """The max_prompt_tokens rule refuses by the count the engine reports as prompt_tokens
    (tests/e2e/test_engine.py checks it against vLLM), not by the 4-characters estimate:
    exactly at the limit runs, one word more is refused, and Japanese far under the limit
    by the estimate is refused by its real count."""
    from jobs.formats.prompts import estimate_tokens, prompt_text
    from jobs.formats.wire import RequestLine
    from jobs.models import ContentRule
    from jobs.policy import Screener

    def line(custom_id: str, text: str) -> RequestLine:
        return RequestLine(custom_id, CHAT, {"model": "SmolLM2-135M-Instruct",
                                                 "messages": [{"role": "user", "content": text}]})

    at_limit = line("at-limit", "word " * 40)
    limit = chat_counter.count(CHAT, at_limit.body)
    japanese = line("japanese", "こんにちは世界" * 6)
    assert estimate_tokens(japanese) < limit // 4 < limit < chat_counter.count(
        CHAT, japanese.body)
    lines = [at_limit, line("one-more", "word " * 41), japanese, line("short", "Hi!")]
    screener = Screener([ContentRule(name="prompt-size", kind="max_prompt_tokens",
                                     max_tokens=limit, action="reject")])
    refused: dict[str, str] = {}
    chunk = [(n, x.custom_id, estimate_tokens(x), prompt_text(x)[0])
             for n, x in enumerate(lines, 1)]
    assert screener.needs_requests("SmolLM2-135M-Instruct")
    screener.screen(chunk, lambda n, custom_id, violation: refused.update(
        {custom_id: violation.rule}), lines)
    screener.flush(lambda *args: None)
    assert refused == {"one-more": "prompt-size", "japanese": "prompt-size"}


def test_a_responses_prompt_counts_as_the_chat_prompt_of_its_messages(chat_counter):
    body = {"instructions": "Be brief.", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Hello there"}]}]}
    chat = chat_body(("system", "Be brief."), ("user", "Hello there"))
    assert chat_counter.count(RESPONSES, body) == chat_counter.count(CHAT, chat)
    assert_over_agrees(chat_counter, RESPONSES, body)
    for text in SAMPLES:
        assert_over_agrees(chat_counter, RESPONSES, {"input": text})
