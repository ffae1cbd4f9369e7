"""Media in request bodies: a part may carry its data (data: URLs, base64) but point only
to the domains the operator allows (BATCHWEB_MEDIA_ALLOWED_DOMAINS), since the engine
would fetch any other URL from inside its network."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import urlsplit

from engine.endpoints.base import INVALID_PARAMETER, Refusal


def host_listed(host: str, patterns: Sequence[str]) -> bool:
    """Whether `host` is one of `patterns`: an exact name, or ".example.com" for that name
    and its subdomains (the operator's allow-lists of webhook hosts and media domains)."""
    host = host.lower().rstrip(".")
    for pattern in patterns:
        pattern = pattern.lower().rstrip(".")
        if pattern.startswith("."):
            if host == pattern[1:] or host.endswith(pattern):
                return True
        elif host == pattern:
            return True
    return False


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def media_problem(part: dict[str, Any], param: str,
                  media_domains: Sequence[str]) -> Refusal | None:
    """Why a media part's URLs are refused: a URL of a domain not allowed, or a scheme
    other than data: and http(s); None when none is."""
    for text in _strings(part):
        if ":" not in text:
            continue  # base64 data, a file id, a format name: no URL
        parts = urlsplit(text.strip())
        scheme = parts.scheme.lower()
        if scheme == "data":
            continue
        if scheme in ("http", "https"):
            host = parts.hostname or ""
            if host and host_listed(host, media_domains):
                continue
            return Refusal(INVALID_PARAMETER,
                           f"{param}: media URLs from {host or 'that address'} are not "
                           "allowed; send the media inline as a data: URL, or ask the "
                           "operator to allow the domain (BATCHWEB_MEDIA_ALLOWED_DOMAINS).",
                           param)
        if "://" in text or scheme == "file":
            return Refusal(INVALID_PARAMETER,
                           f"{param}: only data: URLs and http(s) URLs of allowed domains "
                           "are accepted in media parts.", param)
    return None


def check_parts(content: list[Any], param: str, media_domains: Sequence[str], *,
                text_types: frozenset[str], media_types: frozenset[str]) -> Refusal | None:
    """Content parts of the given types; a media part's URLs as `media_problem`."""
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            continue  # a plain string part: text
        where = f"{param}[{j}]"
        kind = part.get("type")
        if kind in text_types:
            continue
        if kind not in media_types:
            return Refusal(INVALID_PARAMETER,
                           f"{where}.type must be one of "
                           f"{', '.join(sorted(text_types | media_types))}.",
                           f"{where}.type")
        problem = media_problem(part, where, media_domains)
        if problem:
            return problem
    return None
