"""The JSON retry: a structured output that does not parse (or does not match its schema)
is run once more with a new seed; only the final attempt is written."""

from __future__ import annotations

from typing import Any

from engine.base import EngineRequest, EngineResult
from jobs.formats.wire import RequestLine
from jobs.policy.quality import json_problem, output_texts, wants_json

# Appended to a request id for its second run, so its result is known as the final one.
RETRY_SUFFIX = "r"


def is_retry(request_id: str) -> bool:
    return request_id.endswith(RETRY_SUFFIX)


def needs_json_retry(request: RequestLine, result: EngineResult) -> bool:
    if result.status_code != 200:
        return False
    response_format = wants_json(request.url, request.body)
    if response_format is None:
        return False
    return any(json_problem(text, response_format)
               for text, _ in output_texts(request.url, result.body))


def retry_request(request_id: str, request: RequestLine, adapter_path: str, *,
                  cache_salt: str, output_room: int) -> EngineRequest:
    """The second run of a request, with the LoRA adapter folder, the prefix cache salt
    and the output room its first run had."""
    return EngineRequest(request_id=request_id + RETRY_SUFFIX, url=request.url,
                         body=reseeded(request.body), adapter_path=adapter_path,
                         cache_salt=cache_salt, output_room=output_room)


def reseeded(body: dict[str, Any]) -> dict[str, Any]:
    seed = body.get("seed")
    return {**body, "seed": (seed + 1) if isinstance(seed, int) else 1}
