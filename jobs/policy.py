"""Content policy: the operator's rules (ContentRule, edited in the admin) checked on every
input line while a batch validates.

Terms and regular expressions are compiled into one expression, so a line is searched once
whatever the number of rules. The prompt-size rule uses the same estimate as the cost
preview. A moderation rule embeds each prompt with a configured embeddings model, through
the same engine code as inference, and flags it when it is close (cosine similarity) to one
of the rule's example texts; lines are embedded in chunks.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.base import EMBEDDINGS, Engine, EngineRequest
from jobs.wire import RequestLine, estimate_tokens

VIOLATION = "content_policy_violation"
MODERATION_CHUNK = 256


@dataclass(frozen=True)
class Violation:
    rule: str
    action: str  # "reject" or "skip"
    reason: str

    @property
    def message(self) -> str:
        return f"Refused by content rule '{self.rule}'" + (f": {self.reason}" if self.reason
                                                            else ".")


# (line number, custom_id, violation)
ViolationSink = Callable[[int, str, Violation], None]


def prompt_text(line: RequestLine) -> str:
    """All the text a request sends to the model, joined."""
    body = line.body
    if "messages" in body:
        values: list[Any] = [m.get("content") for m in body["messages"]]
    else:
        values = [body.get("prompt", body.get("input"))]
    parts: list[str] = []
    for value in values:
        if isinstance(value, str):
            parts.append(value)
        elif isinstance(value, list):
            parts.extend(v if isinstance(v, str) else str(v.get("text", ""))
                         for v in value if isinstance(v, str | dict))
    return "\n".join(parts)


_ENGINES: dict[str, Engine] = {}


def moderation_engine(model: str) -> Engine:
    """The embeddings engine for a moderation rule, loaded once per process."""
    if model not in _ENGINES:
        from engine import load_engine
        from jobs.engines import model_spec

        spec = model_spec(model)
        if spec is None or EMBEDDINGS not in spec.endpoints:
            raise ValueError(f"moderation model {model!r} is not a configured embeddings model")
        _ENGINES[model] = load_engine(spec)
    return _ENGINES[model]


def embed(model: str, texts: list[str]) -> list[list[float]]:
    engine = moderation_engine(model)
    requests = [EngineRequest(request_id=f"moderation:{i}", url=EMBEDDINGS,
                              body={"model": model, "input": text[:2000]})
                for i, text in enumerate(texts)]
    vectors: dict[int, list[float]] = {}
    for result in engine.run(requests):
        index = int(result.request_id.split(":")[1])
        if result.status_code != 200:
            raise ValueError(f"moderation model failed: {result.body}")
        vectors[index] = result.body["data"][0]["embedding"]
    return [vectors[i] for i in range(len(texts))]


def _unit(vector: list[float]) -> list[float]:
    norm = math.sqrt(sum(x * x for x in vector)) or 1.0
    return [x / norm for x in vector]


class Screener:
    def __init__(self, rules: list[Any]) -> None:
        self.rules = {rule.name: rule for rule in rules}
        pattern_parts = []
        for index, rule in enumerate(rules):
            if rule.kind == "term" and rule.pattern.strip():
                pattern_parts.append(f"(?P<r{index}>\\b{re.escape(rule.pattern.strip())}\\b)")
            elif rule.kind == "regex" and rule.pattern:
                pattern_parts.append(f"(?P<r{index}>{rule.pattern})")
        self.names = {f"r{index}": rule.name for index, rule in enumerate(rules)}
        self.pattern = (re.compile("|".join(pattern_parts), re.IGNORECASE)
                        if pattern_parts else None)
        self.size_rules = [r for r in rules if r.kind == "max_prompt_tokens" and r.max_tokens]
        self.moderation = [r for r in rules if r.kind == "moderation" and r.model]
        self.examples: dict[str, list[list[float]]] = {}
        self.pending: list[tuple[int, str, str]] = []  # (line, custom_id, text)

    @classmethod
    def load(cls) -> Screener | None:
        """The enabled rules, or None when there are none (validation then skips screening)."""
        from jobs.models import ContentRule

        rules = list(ContentRule.objects.filter(enabled=True).order_by("name"))
        return cls(rules) if rules else None

    def violation(self, rule: Any) -> Violation:
        return Violation(rule=rule.name, action=rule.action, reason=rule.reason)

    def check(self, number: int, line: RequestLine, sink: ViolationSink) -> None:
        """Screen one line; violations go to `sink` (moderation ones when their chunk is
        embedded, so call `flush` at the end)."""
        text = prompt_text(line)
        if self.pattern is not None:
            match = self.pattern.search(text)
            if match:
                sink(number, line.custom_id, self.violation(self.rules[self.names[
                    match.lastgroup or ""]]))
                return
        if self.size_rules:
            tokens, _ = estimate_tokens(line)
            for rule in self.size_rules:
                if tokens > rule.max_tokens:
                    sink(number, line.custom_id, self.violation(rule))
                    return
        if self.moderation:
            self.pending.append((number, line.custom_id, text))
            if len(self.pending) >= MODERATION_CHUNK:
                self.flush(sink)

    def flush(self, sink: ViolationSink) -> None:
        if not self.pending:
            return
        chunk, self.pending = self.pending, []
        flagged: set[int] = set()
        for rule in self.moderation:
            if rule.name not in self.examples:
                examples = [t for t in rule.pattern.splitlines() if t.strip()]
                self.examples[rule.name] = [_unit(v) for v in embed(rule.model, examples)]
            vectors = [_unit(v) for v in embed(rule.model, [text for _, _, text in chunk])]
            for (number, custom_id, _), vector in zip(chunk, vectors, strict=True):
                if number in flagged:
                    continue
                score = max((sum(a * b for a, b in zip(vector, example, strict=True))
                             for example in self.examples[rule.name]), default=0.0)
                if score >= (rule.threshold if rule.threshold is not None else 0.8):
                    flagged.add(number)
                    sink(number, custom_id, self.violation(rule))
