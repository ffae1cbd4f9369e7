"""/v1/moderations: OpenAI's moderations, on an embeddings model and example texts.

No PyPI package ships a moderation classifier vLLM can load, so a model that serves
embeddings serves moderations the way the moderation content rule screens prompts
(jobs/policy/moderation.py): each input is embedded in one call with the examples of
every category, and a category's score is the input's highest cosine similarity to one of
its examples (0 below none). An input is flagged in a category at or above the threshold.

The operator sets the categories in the model's options, as a mapping of category to
example texts, and the threshold:

    "options": {"moderation_categories": {"violence": ["..."], "harassment": ["..."]},
                "moderation_threshold": 0.5}

Without them a model uses DEFAULT_CATEGORIES, short descriptions of OpenAI's categories:
enough to try the endpoint, not to moderate anyone; real examples of what the operator
means by each category are what make the scores worth reading.

The answer is OpenAI's shape (`results[].flagged`, `categories`, `category_scores`), with
one addition: its `usage`, the prompt tokens the engine reports for that embeddings call
(the inputs and the category examples embedded with them: what the request computed).
Moderations are metered and priced on those as embeddings are on theirs, so tokens quotas,
the ledger and budgets count them.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from engine.endpoints.base import (
    INVALID_BODY,
    EchoModel,
    ModelOptionsError,
    Pooling,
    Refusal,
    cosine,
)
from engine.endpoints.embeddings import Embeddings

DEFAULT_THRESHOLD = 0.5
DEFAULT_CATEGORIES: dict[str, list[str]] = {
    "harassment": ["insulting, threatening or demeaning a person"],
    "hate": ["demeaning people for their race, religion, gender or origin"],
    "self-harm": ["wanting to hurt or kill oneself"],
    "sexual": ["explicit sexual content"],
    "violence": ["describing or threatening physical violence against someone"],
    "illicit": ["instructions for committing a crime"],
}

_EMBEDDINGS = Embeddings()


def categories_of(options: Mapping[str, Any] | None) -> tuple[dict[str, list[str]], float]:
    """The model's (categories, threshold), the defaults where its options set none."""
    options = options or {}
    categories = options.get("moderation_categories") or DEFAULT_CATEGORIES
    threshold = options.get("moderation_threshold", DEFAULT_THRESHOLD)
    if not isinstance(categories, Mapping) or not all(
            isinstance(name, str) and isinstance(texts, list) and texts
            and all(isinstance(text, str) and text for text in texts)
            for name, texts in categories.items()):
        raise ModelOptionsError(
            "the model's moderation_categories must map each category to a non-empty list "
            "of example texts")
    if not isinstance(threshold, int | float) or isinstance(threshold, bool) \
            or not -1 <= threshold <= 1:
        raise ModelOptionsError("the model's moderation_threshold must be a number "
                                     "from -1 to 1")
    return dict(categories), float(threshold)


def _inputs(body: dict[str, Any]) -> list[str]:
    value = body["input"]
    return [value] if isinstance(value, str) else list(value)


class Moderations(Pooling):
    url = "/v1/moderations"
    fields = frozenset({"input", "model"})
    kind = "embed"
    prompt_field = "input"
    # Every model that serves embeddings serves it, through vLLM's embeddings serving.
    served_through = Embeddings.url
    vllm = Embeddings.vllm
    # vLLM's EmbeddingRequest has no priority field to send.
    takes_priority = Embeddings.takes_priority

    @property
    def serving_url(self) -> str:
        return Embeddings.url

    def check_own(self, body: dict[str, Any], media_domains: Sequence[str]) -> Refusal | None:
        value = body.get("input")
        texts = [value] if isinstance(value, str) else value
        if not isinstance(texts, list) or not texts or not all(
                isinstance(text, str) and text for text in texts):
            return Refusal(INVALID_BODY, "body.input must be a non-empty string or an array "
                           "of non-empty strings (images are not moderated here).",
                           "body.input")
        return None

    def prompts(self, body: dict[str, Any]) -> list[Any]:
        return _inputs(body)

    def prompt_values(self, body: dict[str, Any]) -> list[Any]:
        return [body.get("input")]

    def engine_body(self, body: dict[str, Any], *,
                    options: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """One embeddings call: the inputs, then every category's examples."""
        categories, _ = categories_of(options)
        examples = [text for texts in categories.values() for text in texts]
        return {"model": body["model"], "input": _inputs(body) + examples}

    def from_serving(self, body: dict[str, Any], answer: dict[str, Any], *,
                     options: Mapping[str, Any] | None = None) -> dict[str, Any]:
        categories, threshold = categories_of(options)
        vectors = [item["embedding"] for item in sorted(answer["data"],
                                                        key=lambda item: item["index"])]
        count = len(_inputs(body))
        inputs, examples = vectors[:count], iter(vectors[count:])
        example_vectors = {name: [next(examples) for _ in texts]
                           for name, texts in categories.items()}
        results = []
        for vector in inputs:
            scores = {name: round(max(0.0, *(cosine(vector, example) for example in found)), 6)
                      for name, found in example_vectors.items()}
            flags = {name: score >= threshold for name, score in scores.items()}
            results.append({"flagged": any(flags.values()), "categories": flags,
                            "category_scores": scores})
        tokens = int((answer.get("usage") or {}).get("prompt_tokens") or 0)
        return {"id": f"modr-{uuid.uuid4().hex}", "model": body.get("model") or answer.get("model"),
                "results": results,
                # Not in OpenAI's answer (clients keep it as an extra): what is metered.
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    def echo(self, body: dict[str, Any], model: EchoModel) -> dict[str, Any]:
        return self.from_serving(
            body, _EMBEDDINGS.echo(self.engine_body(body, options=model.options), model),
            options=model.options)

    def show_response(self, body: dict[str, Any]) -> str | None:
        """Each input's flagged categories."""
        results = body.get("results")
        if not isinstance(results, list) or not str(body.get("id", "")).startswith("modr-"):
            return None
        lines = []
        for result in results:
            if not isinstance(result, dict):
                continue
            flagged = [name for name, on in (result.get("categories") or {}).items() if on]
            lines.append(f"flagged: {', '.join(flagged)}" if flagged else "not flagged")
        return "\n".join(lines)
