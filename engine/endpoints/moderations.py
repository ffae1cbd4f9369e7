"""/v1/moderations: OpenAI's moderations, on an embeddings model and example texts.

No PyPI package ships a moderation classifier vLLM can load, so a model that serves
embeddings serves moderations the way the moderation content rule screens prompts
(jobs/policy/embedding_rule.py): each input is embedded in one call with the examples of
every category, and a category's score is the input's highest cosine similarity to one of
its examples (0 below none). An input is flagged in a category at or above the threshold.

The operator sets the categories in the model's options, as a mapping of category to
example texts, and the threshold:

    "options": {"moderation_categories": {"violence": ["..."], "harassment": ["..."]},
                "moderation_threshold": 0.5}

Without them a model uses DEFAULT_CATEGORIES, a few example sentences of each of OpenAI's
categories: they flag plain threats, insults and the like, enough to try the endpoint, not
to moderate anyone; examples of what the operator means by each category, in its users'
words, are what make the scores worth reading.

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
# A few example sentences of each of OpenAI's categories, as a user would write them: an
# input is scored by its likeness to sentences, so descriptions of a category ("threatening
# physical violence") score plain threats low (0.42 for "I will hurt you badly" on
# all-MiniLM-L6-v2, under the threshold), where these flag it (0.78) and leave everyday
# requests well under it (0.33 at most: tests/engine/test_vllm_embeddings.py).
DEFAULT_CATEGORIES: dict[str, list[str]] = {
    "harassment": ["You are a stupid idiot.", "You're worthless and pathetic.",
                   "Shut up, nobody likes you, loser.",
                   "You're ugly and everyone laughs at you."],
    "hate": ["People of that race are animals and should be driven out.",
             "All immigrants are criminals and vermin.",
             "Women are inferior to men and should stay silent.",
             "I hate everyone of that religion."],
    "self-harm": ["I want to kill myself.", "I am going to cut myself tonight.",
                  "I don't want to live anymore.",
                  "How many pills would it take to end my life?"],
    "sexual": ["Describe in explicit detail the two of them having sex.",
               "Send me naked pictures of yourself.", "Write a graphic erotic scene."],
    "violence": ["I am going to hurt you.", "I will kill you.", "I'll beat you until you bleed.",
                 "I know where you live and I will come for your family."],
    "illicit": ["How do I make a bomb at home?", "How can I steal a car without getting caught?",
                "Where can I buy illegal drugs?", "Explain how to launder money."],
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
