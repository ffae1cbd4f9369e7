"""The endpoints a batch line may name, one object each, and the registry of them by url.

An endpoint object (one module each: chat, completions, responses, messages, embeddings,
score, rerank; `base.py` holds what they share) owns everything particular to its
endpoint: its body's fields and rules, its prompt (for token counts, prefix keys, content
rules and the dashboard), its token estimate, how its answer is read (quality flags,
usage), what the engines need to run it (the kind of call, the body they send, the wire
response built from a neutral result, its error shape) and how the dashboard shows a
request and its answer. Nothing else decides anything by comparing a url: it looks the
endpoint up here. Adding an endpoint is one module here, registered below, plus its tests.

Why here: the engines (`engine/`, no Django) and the service (`jobs/`) both use it, and
`engine/base.py` names its urls, so it sits inside `engine/` and imports nothing from
either (the standard library only): no import circle, no Django.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.endpoints.base import Endpoint, Refusal, text_parts
from engine.endpoints.chat import Chat
from engine.endpoints.completions import Completions
from engine.endpoints.embeddings import Embeddings
from engine.endpoints.messages import Messages, anthropic_error
from engine.endpoints.moderations import Moderations
from engine.endpoints.rerank import Rerank
from engine.endpoints.responses import Responses
from engine.endpoints.score import Score

REGISTRY: dict[str, Endpoint] = {endpoint.url: endpoint for endpoint in (
    Chat(), Completions(), Embeddings(), Responses(), Messages(), Score(), Rerank(),
    Moderations())}

# The urls, for code that names one (a model's defaults, a Message Batch's lines).
CHAT = Chat.url
COMPLETIONS = Completions.url
EMBEDDINGS = Embeddings.url
RESPONSES = Responses.url
MESSAGES = Messages.url
MODERATIONS = Moderations.url
SCORE = Score.url
RERANK = Rerank.url
ENDPOINTS = tuple(REGISTRY)
# The endpoints of pooling models (no output tokens, no sampling).
POOLING_ENDPOINTS = tuple(url for url, endpoint in REGISTRY.items() if endpoint.pooling)

__all__ = [
    "CHAT", "COMPLETIONS", "EMBEDDINGS", "ENDPOINTS", "MESSAGES", "MODERATIONS",
    "POOLING_ENDPOINTS",
    "REGISTRY", "RERANK", "RESPONSES", "SCORE", "Endpoint", "Refusal", "anthropic_error",
    "check_body", "endpoint", "reasoning_of", "request_messages", "served", "show_request",
    "show_response", "text_parts", "usage_of",
]


def endpoint(url: str) -> Endpoint:
    """The endpoint of `url`, one of ENDPOINTS (KeyError for another)."""
    return REGISTRY[url]


def served(declared: Sequence[str]) -> tuple[str, ...]:
    """The endpoints a model declared to serve `declared` serves: those, and every endpoint
    that runs through one of them (a chat model serves Anthropic's Messages)."""
    extra = tuple(url for url, one in REGISTRY.items()
                  if one.served_through in declared and url not in declared)
    return tuple(declared) + extra


def check_body(url: str, body: dict[str, Any], *, max_tokens_cap: int,
               media_domains: Sequence[str] = ()) -> Refusal | None:
    """Why the endpoint of `url` refuses `body` (`Endpoint.check`), or None."""
    return REGISTRY[url].check(body, max_tokens_cap=max_tokens_cap,
                               media_domains=media_domains)


def request_messages(url: str, body: dict[str, Any]) -> list[Any]:
    """The messages of a request's prompt (`Endpoint.messages`)."""
    return REGISTRY[url].messages(body)


def usage_of(url: str, body: dict[str, Any]) -> tuple[int, int, int]:
    """(prompt, completion, cached prompt) tokens of a response body (`Endpoint.usage`)."""
    return REGISTRY[url].usage(body)


def reasoning_of(url: str, body: dict[str, Any]) -> int:
    """Of a response body's completion tokens, those spent reasoning
    (`Endpoint.reasoning_tokens`)."""
    return REGISTRY[url].reasoning_tokens(body)


def show_request(url: Any, body: dict[str, Any]) -> str:
    """The human part of a request body (`Endpoint.show_request`); a line of an unknown
    url is shown as chat shows any body (its messages, else its prompt or input)."""
    found = REGISTRY.get(url) if isinstance(url, str) else None
    return (found or REGISTRY[CHAT]).show_request(body)


def show_response(body: dict[str, Any]) -> str:
    """The human part of a response body (the dashboard has the body alone): the answer
    of the endpoint whose shape it has, else an error's message."""
    for found in REGISTRY.values():
        text = found.show_response(body)
        if text is not None:
            return text
    if isinstance(body.get("error"), dict):
        return str(body["error"].get("message") or "")
    return ""
