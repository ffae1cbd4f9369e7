"""What validation and the worker read of a request line's prompt, each its endpoint's
(engine.endpoints): its text and size for the estimate and the content rules, its cost
ceiling and the output limit it runs with, and the dedup key of a body whose answer it
fully determines. A refused line never runs: it has no prompt to estimate or screen,
nothing to cost and nothing to share."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import NamedTuple

from django.conf import settings

from engine.endpoints import endpoint
from jobs.engines import model_spec
from jobs.formats.wire import RequestLine


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
    """What a model leaves a request's output: its context (the registry's max_model_len;
    None where it does not say) less the prompt, at most the service's cap
    (BATCHWEB_MAX_TOKENS_CAP)."""

    context: int | None
    cap: int

    def after(self, prompt_tokens: int) -> int:
        if self.context is None:
            return self.cap
        return max(1, min(self.cap, self.context - prompt_tokens))


def room_for(model: str | None) -> Room:
    """The room of a served model's requests (an adapter's are its base model's)."""
    spec = model_spec(model) if model else None
    context = spec.options.get("max_model_len") if spec is not None else None
    return Room(context=int(context) if context else None,
                cap=int(settings.BATCHWEB["MAX_TOKENS_CAP"]))


class Ceiling(NamedTuple):
    """The most a request can use: its prompt's tokens (`Endpoint.prompt_bound`) and its
    output tokens, all answers together."""

    input_tokens: int
    output_tokens: int


def ceiling(line: RequestLine, room: Room) -> Ceiling:
    """What the budget counts for a request: a request that names no output limit counts
    the one it runs with (`output_room`), never 0. A refused line never runs: nothing."""
    if line.refused is not None:
        return Ceiling(0, 0)
    found = endpoint(line.url)
    prompt = found.prompt_bound(line.body)
    return Ceiling(prompt, found.output_ceiling(line.body, room=room.after(prompt)))


def output_room(line: RequestLine, room: Room) -> int:
    """The output limit of one answer `ceiling` counted for a request that names none: the
    worker hands it to the engine with the request (`EngineRequest.output_room`), which
    sends it on as the request's limit (else the engine would generate up to the model's
    context, past what the budget counted)."""
    return room.after(endpoint(line.url).prompt_bound(line.body))


def dedup_key(line: RequestLine) -> bytes | None:
    """A digest of the request when its result is fully determined by its content
    (`Endpoint.deterministic`: a pooling endpoint, greedy sampling, or a fixed seed); None
    when two runs may rightly differ."""
    if line.refused is not None or not endpoint(line.url).deterministic(line.body):
        return None
    canonical = json.dumps([line.url, line.body], sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(canonical.encode(), digest_size=16).digest()
