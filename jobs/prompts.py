"""What validation reads of a request line's prompt, each its endpoint's
(engine.endpoints): its text and size for the estimate and the content rules, and the
dedup key of a body whose answer it fully determines. A refused line never runs: it has
no prompt to estimate or screen, and nothing to share."""

from __future__ import annotations

import hashlib
import json

from engine.endpoints import endpoint
from jobs.wire import RequestLine


def prompt_text(line: RequestLine) -> tuple[str, int]:
    """(text, characters) of what a request sends to the model (`Endpoint.prompt_text`).
    Validation computes it once per line, for the estimate and for the content rules."""
    if line.refused is not None:
        return "", 0
    return endpoint(line.url).prompt_text(line.body)


def estimate_tokens(line: RequestLine, chars: int | None = None) -> tuple[int, int]:
    """(input tokens, output-token ceiling) estimated without a tokenizer: ~4 characters a
    token, which is close for English with BPE tokenizers. `chars` is `prompt_text`'s
    count, when the caller has it."""
    if line.refused is not None:
        return 1, 0
    if chars is None:
        chars = prompt_text(line)[1]
    return max(1, chars // 4), endpoint(line.url).output_ceiling(line.body)


def dedup_key(line: RequestLine) -> bytes | None:
    """A digest of the request when its result is fully determined by its content
    (`Endpoint.deterministic`: a pooling endpoint, greedy sampling, or a fixed seed); None
    when two runs may rightly differ."""
    if line.refused is not None or not endpoint(line.url).deterministic(line.body):
        return None
    canonical = json.dumps([line.url, line.body], sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(canonical.encode(), digest_size=16).digest()
