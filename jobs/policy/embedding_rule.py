"""The moderation rule of content policy (a ContentRule of kind moderation; not the
/v1/moderations endpoint, engine/endpoints/moderations.py): each prompt embedded with a
configured embeddings model, through the same engine code as inference, and flagged when it
is close (cosine similarity) to one of the rule's example texts. Lines are embedded in
chunks."""

from __future__ import annotations

import math
from typing import Any

from engine.base import Engine, EngineRequest
from engine.endpoints import EMBEDDINGS
from jobs.policy.violation import Violation, ViolationSink

MODERATION_CHUNK = 256

_ENGINES: dict[str, Engine] = {}


def moderation_engine(model: str) -> Engine:
    """The embeddings engine for a moderation rule, loaded once per process."""
    if model not in _ENGINES:
        from engine import load_engine
        from jobs.lib.model_registry import model_spec

        spec = model_spec(model)
        if spec is None or EMBEDDINGS not in spec.endpoints:
            raise ValueError(f"moderation model {model!r} is not a configured embeddings model")
        _ENGINES[model] = load_engine(spec)
    return _ENGINES[model]


def close_engines() -> None:
    """Shut down the moderation engines this process loaded (at worker stop: a vLLM engine
    left to the interpreter's exit can hang it)."""
    while _ENGINES:
        _, engine = _ENGINES.popitem()
        engine.close()


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


class Moderation:
    """The moderation rules of a rule list, and the lines waiting to be embedded for them
    (`add`); they are embedded MODERATION_CHUNK at a time, the rest at `flush`."""

    def __init__(self, rules: list[Any]) -> None:
        self.rules = [r for r in rules if r.kind == "moderation" and r.model]
        self.examples: dict[str, list[list[float]]] = {}
        self.pending: list[tuple[int, str, str]] = []  # (line, custom_id, text)

    def add(self, number: int, custom_id: str, text: str) -> None:
        self.pending.append((number, custom_id, text))

    def flush_full(self, sink: ViolationSink) -> None:
        """Embed the lines waiting, if they make a chunk."""
        if len(self.pending) >= MODERATION_CHUNK:
            self.flush(sink)

    def flush(self, sink: ViolationSink) -> None:
        """Embed the lines waiting; those close to an example go to `sink`."""
        if not self.pending:
            return
        chunk, self.pending = self.pending, []
        flagged: set[int] = set()
        for rule in self.rules:
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
                    sink(number, custom_id, Violation.of(rule))
