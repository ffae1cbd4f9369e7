"""A seeded corpus of request bodies on every chat face (chat completions, Anthropic's
Messages, Responses) in the shapes whose prompt tokens a budget must bound: with and
without a system message, tools, tool calls and tool results, long and short, English,
CJK and emoji. Bodies name no model and no output limit: the caller adds both."""

from __future__ import annotations

import json
import random
from typing import Any

from engine.endpoints import CHAT, MESSAGES, RESPONSES

WORDS = ["budget", "token", "river", "compile", "ledger", "shard", "amber", "quartz",
         "north", "window", "retry", "matrix", "orbit", "velvet", "signal", "harbor"]
CJK = "数据批处理模型预算令牌东京大阪雨雪山川電車駅天気예산토큰"
EMOJI = "🎉🚀👍🏽🧑‍🚀🌧️🍣🔥✅"


def text(rng: random.Random, size: int) -> str:
    """About `size` characters of English, CJK, emoji or a mix of them."""
    kind = rng.choice(["en", "cjk", "emoji", "mix"])
    out: list[str] = []
    length = 0
    while length < size:
        pick = kind if kind != "mix" else rng.choice(["en", "cjk", "emoji"])
        if pick == "en":
            piece = rng.choice(WORDS) + rng.choice([" ", ", ", ". ", "\n"])
        elif pick == "cjk":
            piece = "".join(rng.choice(CJK) for _ in range(rng.randint(1, 6)))
        else:
            piece = rng.choice(EMOJI)
        out.append(piece)
        length += len(piece)
    return "".join(out)


def schema(rng: random.Random) -> dict[str, Any]:
    return {"type": "object", "properties": {
        rng.choice(WORDS) + str(i): {"type": rng.choice(["string", "integer"]),
                                     "description": text(rng, rng.randint(5, 80))}
        for i in range(rng.randint(1, 4))}, "required": []}


def arguments(rng: random.Random) -> dict[str, Any]:
    return {rng.choice(WORDS): text(rng, rng.randint(1, 60)) for _ in range(rng.randint(1, 3))}


def chat_body(rng: random.Random, size: int) -> dict[str, Any]:
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": text(rng, size // 4 + 1)})
    messages.append({"role": "user", "content": rng.choice([
        text(rng, size), [{"type": "text", "text": text(rng, size // 2 + 1)},
                          {"type": "text", "text": text(rng, size // 2 + 1)}]])})
    body: dict[str, Any] = {"messages": messages}
    if rng.random() < 0.6:
        name = rng.choice(WORDS)
        body["tools"] = [{"type": "function", "function": {
            "name": f"{name}_{i}", "description": text(rng, rng.randint(10, max(10, size))),
            "parameters": schema(rng)}} for i in range(rng.randint(1, 3))]
        if rng.random() < 0.7:
            call_id = f"call_{rng.randint(0, 10**6)}"
            messages.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": call_id, "type": "function",
                 "function": {"name": f"{name}_0", "arguments": json.dumps(arguments(rng))}}]})
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "content": text(rng, rng.randint(5, max(5, size)))})
            messages.append({"role": "user", "content": text(rng, 20)})
    return body


def messages_body(rng: random.Random, size: int) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": rng.choice([
        text(rng, size), [{"type": "text", "text": text(rng, size)}]])}]}
    if rng.random() < 0.5:
        body["system"] = rng.choice([text(rng, size // 4 + 1),
                                     [{"type": "text", "text": text(rng, size // 4 + 1)}]])
    if rng.random() < 0.6:
        name = rng.choice(WORDS)
        body["tools"] = [{"name": f"{name}_{i}",
                          "description": text(rng, rng.randint(10, max(10, size))),
                          "input_schema": schema(rng)} for i in range(rng.randint(1, 3))]
        if rng.random() < 0.7:
            use_id = f"toolu_{rng.randint(0, 10**6)}"
            body["messages"] += [
                {"role": "assistant", "content": [
                    {"type": "text", "text": text(rng, 20)},
                    {"type": "tool_use", "id": use_id, "name": f"{name}_0",
                     "input": arguments(rng)}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": use_id, "content": rng.choice([
                        text(rng, rng.randint(5, max(5, size))),
                        [{"type": "text", "text": text(rng, rng.randint(5, max(5, size)))}]])},
                    {"type": "text", "text": text(rng, 20)}]}]
    return body


def responses_body(rng: random.Random, size: int) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if rng.random() < 0.5:
        body["instructions"] = text(rng, size // 4 + 1)
    if rng.random() < 0.3:
        body["input"] = text(rng, size)
        return body
    items: list[dict[str, Any]] = [{"role": "user", "content": rng.choice([
        text(rng, size), [{"type": "input_text", "text": text(rng, size)}]])}]
    if rng.random() < 0.6:
        name = rng.choice(WORDS)
        body["tools"] = [{"type": "function", "name": f"{name}_{i}",
                          "description": text(rng, rng.randint(10, max(10, size))),
                          "parameters": schema(rng)} for i in range(rng.randint(1, 3))]
        if rng.random() < 0.7:
            call_id = f"call_{rng.randint(0, 10**6)}"
            items += [{"type": "function_call", "call_id": call_id, "name": f"{name}_0",
                       "arguments": json.dumps(arguments(rng))},
                      {"type": "function_call_output", "call_id": call_id,
                       "output": text(rng, rng.randint(5, max(5, size)))}]
    body["input"] = items
    return body


FACES = {CHAT: chat_body, MESSAGES: messages_body, RESPONSES: responses_body}


def corpus(seed: int, count: int, *, sizes: tuple[int, ...] = (8, 60, 400)) -> list[
        tuple[str, dict[str, Any]]]:
    """`count` (url, body) pairs, faces and sizes in turn."""
    rng = random.Random(seed)
    urls = list(FACES)
    return [(urls[i % len(urls)], FACES[urls[i % len(urls)]](rng, sizes[i // 3 % len(sizes)]))
            for i in range(count)]
