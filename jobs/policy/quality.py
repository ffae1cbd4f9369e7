"""Quality flags on finished requests: outputs that look wrong even though the request
succeeded, so a long run cannot "finish but drift" unnoticed. The output
line format is never changed; flags are kept beside it."""

from __future__ import annotations

import json
from typing import Any

from engine.endpoints import endpoint

EMPTY = "empty_output"
LENGTH = "length_limit"
REPETITION = "repetition"
INVALID_JSON = "invalid_json"
FLAGS = (EMPTY, LENGTH, REPETITION, INVALID_JSON)
FLAG_LABELS = {
    EMPTY: "Empty output",
    LENGTH: "Stopped by the length limit",
    REPETITION: "Degenerate repetition",
    INVALID_JSON: "Not valid JSON / not matching the schema",
}


def wants_json(url: str, body: dict[str, Any]) -> dict[str, Any] | None:
    """The JSON format a request asked for (`Endpoint.json_format`: a chat request's
    `response_format`, a Responses request's `text.format`), else None."""
    response_format = endpoint(url).json_format(body)
    if isinstance(response_format, dict) and response_format.get("type") in (
            "json_object", "json_schema"):
        return response_format
    return None


def json_problem(text: str, response_format: dict[str, Any]) -> str | None:
    """Why `text` does not satisfy a JSON format (`wants_json`), or None when it does."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        return f"not valid JSON: {exc}"
    if response_format.get("type") == "json_object" and not isinstance(value, dict):
        return "not a JSON object"
    # chat's response_format holds its schema under json_schema, text.format in itself.
    nested = response_format.get("json_schema")
    schema = (nested.get("schema") if isinstance(nested, dict)
              else response_format.get("schema"))
    if response_format.get("type") == "json_schema" and isinstance(schema, dict):
        # Imported here: most workers never check a schema, and jsonschema's import is
        # ~0.06 s of each worker's start.
        import jsonschema

        try:
            jsonschema.validate(value, schema)
        except jsonschema.ValidationError as exc:
            return f"does not match the schema: {exc.message}"
        except jsonschema.SchemaError:
            return None  # the user's schema is broken, not the output
    return None


def is_repetitive(text: str, *, max_n: int = 8, min_repeats: int = 4) -> bool:
    """Whether the text ends in one n-gram looping: its last n words (characters, for text
    with few spaces) repeated `min_repeats` times in a row, for some n <= max_n. A single
    repeated unit needs a longer run (16) to count: "!!!!" is emphasis, not a loop."""
    units: list[str] = text.split()
    if len(units) < 8:
        units = list(text.strip())
    for n in range(1, max_n + 1):
        repeats = 16 if n == 1 else min_repeats
        if len(units) < n * repeats:
            continue
        tail = units[-n:]
        end = len(units)
        if all(units[end - n * (k + 1): end - n * k] == tail for k in range(repeats)):
            return True
    return False


def output_texts(url: str, body: dict[str, Any]) -> list[tuple[str, str | None]]:
    """(text, finish_reason) of each answer of a response body (`Endpoint.output_texts`);
    "length" is the stop at the output-token cap."""
    return endpoint(url).output_texts(body)


def flags_for(url: str, request: dict[str, Any], response: dict[str, Any]) -> list[str]:
    """The flags of one successful response, in FLAGS order."""
    found: set[str] = set()
    response_format = wants_json(url, request)
    for text, finish_reason in output_texts(url, response):
        if not text.strip():
            found.add(EMPTY)
        if finish_reason == "length":
            found.add(LENGTH)
        if is_repetitive(text):
            found.add(REPETITION)
        if response_format and text.strip() and json_problem(text, response_format):
            found.add(INVALID_JSON)
    return [flag for flag in FLAGS if flag in found]
