"""What validation and the worker read of a request line's prompt, each its endpoint's
(engine.endpoints): its text and size for the estimate and the content rules, its cost
ceiling and the output limit it runs with, and the dedup key of a body whose answer it
fully determines. A refused line never runs: it has no prompt to estimate or screen,
nothing to cost and nothing to share."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from django.conf import settings

from engine.base import ModelSpec
from engine.endpoints import endpoint
from engine.tokens import PromptCounter
from jobs.formats.wire import RequestLine
from jobs.lib.model_registry import model_spec


def prompt_text(line: RequestLine) -> tuple[str, int]:
    """(text, characters) of what a request sends to the model (`Endpoint.prompt_text`).
    Validation computes it once per line, for the estimate and for the content rules."""
    if line.refused is not None:
        return "", 0
    return endpoint(line.url).prompt_text(line.body)


def estimate_tokens(line: RequestLine, chars: int | None = None) -> int:
    """The prompt's tokens as prefix planning and the content rules' chunks count them,
    without a tokenizer: ~4 characters a token, which is close for English with BPE
    tokenizers (the budget counts a bound that holds for any script instead: `ceiling`).
    `chars` is `prompt_text`'s count, when the caller has it."""
    if line.refused is not None:
        return 1
    if chars is None:
        chars = prompt_text(line)[1]
    return max(1, chars // 4)


@dataclass(frozen=True)
class Room:
    """What a model leaves a request: its context (the registry's max_model_len; None where
    it does not say) less the prompt, at most the service's cap (BATCHWEB_MAX_TOKENS_CAP);
    and how its prompts are bounded: by its own tokenizer and chat template where this host
    has them (`counter`), each media part at `media_tokens`; its registry `options`, which
    an endpoint served through another's call builds that call from."""

    context: int | None
    cap: int
    counter: PromptCounter | None = None
    media_tokens: int = 0
    options: Mapping[str, Any] = field(default_factory=dict)

    def after(self, prompt_tokens: int) -> int:
        if self.context is None:
            return self.cap
        return max(1, min(self.cap, self.context - prompt_tokens))


def room_for(model: str | None) -> Room:
    """The room of a served model's requests (an adapter's are its base model's)."""
    spec = model_spec(model) if model else None
    options = spec.options if spec is not None else {}
    context = int(options["max_model_len"]) if options.get("max_model_len") else None
    cap = int(settings.BATCHWEB["MAX_TOKENS_CAP"])
    # What one image, audio clip or file may cost at most: the registry's
    # `max_tokens_per_media`, else all of the model's context.
    media = options.get("max_tokens_per_media") or context or cap
    return Room(context=context, cap=cap, counter=counter_for(spec), media_tokens=int(media),
                options=options)


_COUNTERS: dict[tuple[str, str, str], PromptCounter | None] = {}
_COUNTERS_LOCK = threading.Lock()


def counter_for(spec: ModelSpec | None) -> PromptCounter | None:
    """The prompt counter of a model whose tokenizer this host has (a vLLM model's files,
    or a remote model's `tokenizer` option), loaded once per process; None for the others
    (the test engine, a remote model that names none) or where transformers is not
    installed (a web image without the engine)."""
    if spec is None:
        return None
    source = spec.options.get("tokenizer") or (spec.path if spec.backend == "vllm" else "")
    if not source:
        return None
    key = (spec.name, str(source), str(spec.options.get("chat_template") or ""))
    with _COUNTERS_LOCK:
        if key not in _COUNTERS:
            try:
                _COUNTERS[key] = PromptCounter(spec)
            except (ImportError, OSError):
                _COUNTERS[key] = None
        return _COUNTERS[key]


def prompt_bound(line: RequestLine, room: Room) -> int:
    """The most prompt tokens the engine can count for a request: by the model's own
    tokenizer and template where `room` has them, else one token per byte
    (`Endpoint.prompt_bound`); each media part at the model's `media_tokens`. What the
    worker sends is bounded, not only the line: an endpoint served through another's call
    counts that call."""
    url, body = line.url, line.body
    found = endpoint(url)
    if found.serving_url != url:
        # It runs as another endpoint's call (a moderation as one embeddings call of its
        # inputs and the model's category examples): that call is what the engine counts.
        url, body = found.serving_url, found.engine_body(body, options=room.options)
        found = endpoint(url)
    tokens = room.counter.prompt_bound(url, body) if room.counter else None
    if tokens is None:
        tokens = found.prompt_bound(body)
    return tokens + room.media_tokens * found.media(body)


class Ceiling(NamedTuple):
    """The most a request can use: its prompt's tokens (`prompt_bound`) and its output
    tokens, all answers together."""

    input_tokens: int
    output_tokens: int


def ceiling(line: RequestLine, room: Room) -> Ceiling:
    """What the budget counts for a request: a request that names no output limit counts
    the one it runs with (`output_room`), never 0. A refused line never runs: nothing."""
    if line.refused is not None:
        return Ceiling(0, 0)
    prompt = prompt_bound(line, room)
    return Ceiling(prompt, endpoint(line.url).output_ceiling(line.body,
                                                            room=room.after(prompt)))


def output_room(line: RequestLine, room: Room) -> int:
    """The output limit of one answer `ceiling` counted for a request that names none: the
    worker hands it to the engine with the request (`EngineRequest.output_room`), which
    sends it on as the request's limit (else the engine would generate up to the model's
    context, past what the budget counted). 0 for a request with a limit of its own (the
    engine sends that one): its prompt is not bounded again."""
    found = endpoint(line.url)
    if found.named_limit(line.body) is not None or found.default_limit is not None:
        return 0
    return room.after(prompt_bound(line, room))


def dedup_key(line: RequestLine) -> bytes | None:
    """A digest of the request when its result is fully determined by its content
    (`Endpoint.deterministic`: a pooling endpoint, greedy sampling, or a fixed seed); None
    when two runs may rightly differ."""
    if line.refused is not None or not endpoint(line.url).deterministic(line.body):
        return None
    canonical = json.dumps([line.url, line.body], sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(canonical.encode(), digest_size=16).digest()
