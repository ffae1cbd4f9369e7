"""The scoring rules of eval sets: whether one answer passes against its expected answer.

Each rule written once: `expected_problem` says, when a set is created, why an item's
expected answer cannot be scored by the rule; `passes` scores an answer. The embedding rule
needs a served embeddings model (jobs.services.evals embeds, then calls `similar`).
"""

from __future__ import annotations

import json
import math
import re
import string
from typing import Any

import re2

from jobs.lib.re2check import error_text

EXACT = "exact"
NORMALIZED = "normalized"
REGEX = "regex"
JSON_FIELDS = "json_fields"
NUMERIC = "numeric"
EMBEDDING = "embedding"
RULES = (EXACT, NORMALIZED, REGEX, JSON_FIELDS, NUMERIC, EMBEDDING)

_SPACES = re.compile(r"\s+")
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_PUNCTUATION = string.punctuation + "“”‘’«»…"


def normalized(text: str) -> str:
    """Case folded, runs of white space as one space, punctuation at either end dropped."""
    return _SPACES.sub(" ", text.casefold()).strip().strip(_PUNCTUATION).strip()


def expected_problem(rule: str, expected: Any) -> str | None:
    """Why `expected` cannot be an item's expected answer under `rule`, or None."""
    if rule in (EXACT, NORMALIZED, EMBEDDING):
        return None if isinstance(expected, str) else "expected must be a string."
    if rule == REGEX:
        if not isinstance(expected, str):
            return "expected must be a regular expression (a string)."
        try:
            re2.compile(expected)
        except re2.error as exc:
            return f"expected is not an RE2 regular expression: {error_text(exc)}"
        return None
    if rule == JSON_FIELDS:
        return None if isinstance(expected, dict) and expected else (
            "expected must be an object of the fields the answer's JSON must hold.")
    if rule == NUMERIC:
        return None if isinstance(expected, int | float) and not isinstance(
            expected, bool) and math.isfinite(expected) else "expected must be a number."
    return f"unknown rule {rule!r}"


def first_number(text: str) -> float | None:
    match = _NUMBER.search(text.replace(",", ""))
    return float(match.group()) if match else None


def passes(rule: str, answer: str, expected: Any, *, tolerance: float = 0.0) -> bool:
    """Whether `answer` passes against `expected` (every rule but EMBEDDING)."""
    if rule == EXACT:
        return answer == expected
    if rule == NORMALIZED:
        return normalized(answer) == normalized(expected)
    if rule == REGEX:
        return re2.search(expected, answer) is not None
    if rule == JSON_FIELDS:
        try:
            value = json.loads(answer)
        except ValueError:
            return False
        return isinstance(value, dict) and all(
            name in value and value[name] == wanted for name, wanted in expected.items())
    if rule == NUMERIC:
        number = first_number(answer)
        return number is not None and abs(number - float(expected)) <= tolerance
    raise ValueError(f"rule {rule!r} is not scored by passes()")


def similar(a: list[float], b: list[float], *, threshold: float) -> bool:
    """The embedding rule: cosine similarity of the two embeddings at least `threshold`."""
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norms = math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))
    return bool(norms) and dot / norms >= threshold
