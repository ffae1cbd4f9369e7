"""/v1/score: vLLM's score API. A request pairs the inputs of its two sides (1:1, 1:N or
N:N) and is answered one score per pair. A pooling model serves it: a cross-encoder scores
each pair, an embeddings model (the default here) the cosine similarity of the two
embeddings. What it shares with /v1/rerank (the inputs of a side, the scoring fields)
lives here too."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

from engine.endpoints.base import (
    INVALID_BODY,
    MISSING_PARAMETER,
    EchoModel,
    Pooled,
    Pooling,
    Refusal,
    VllmServing,
    context_refusal,
    cosine,
    echo_vector,
    text_parts,
)
from engine.endpoints.media import check_parts

# The names vLLM's ScoreRequest accepts for a score request's two sides, one pair a body.
SCORE_SIDES = (("queries", "documents"), ("queries", "items"), ("text_1", "text_2"),
               ("data_1", "data_2"))
# Score and rerank share vLLM's scoring parameters: truncation (of the whole prompt, of
# each query, of each document) and use_activation (a cross-encoder's sigmoid; an
# embeddings model's cosine does not change with it). Left out: chat_template_kwargs and
# its shorthand `instruction`, which steer the model's score template as chat_template
# does a chat (and an embeddings model ignores them), and the engine-internal request_id,
# priority, cache_salt, mm_processor_kwargs, padding and truncation_side.
SCORING_FIELDS = frozenset({"model", "user", "truncate_prompt_tokens", "max_tokens_per_query",
                            "max_tokens_per_doc", "use_activation"})
# Content part types of a score or rerank input (vLLM's ScoreContentPartParam, less
# image_embeds, which is not request content); its media URLs as a chat message's.
TEXT_PART_TYPES = frozenset({"text"})
MEDIA_PART_TYPES = frozenset({"image_url", "video_url"})


def score_pair(body: dict[str, Any]) -> tuple[str, str] | None:
    """The pair of SCORE_SIDES a score body names its sides with; None when it names none,
    one side only, or sides of two pairs."""
    named = {name for pair in SCORE_SIDES for name in pair if name in body}
    return next((pair for pair in SCORE_SIDES if named == set(pair)), None)


def named_sides(body: dict[str, Any], names: tuple[str, str]) -> list[tuple[str, list[Any]]]:
    """The two sides named `names`, each as (field name, inputs): a single input is a list
    of one, and each input is given as its content, a string or a list of content parts
    (vLLM's `{"content": [...]}` inputs), whose texts are `text_parts`."""
    sides = []
    for name in names:
        value = body.get(name)
        inputs = value if isinstance(value, list) else [value]
        sides.append((name, [item.get("content") if isinstance(item, dict) else item
                             for item in inputs]))
    return sides


def check_inputs(value: Any, param: str, media_domains: Sequence[str], *,
                 many: bool = True) -> Refusal | None:
    """One side of a score or rerank body: an input (a string, or an object whose
    `content` is an array of parts) or, when `many`, a non-empty array of them."""
    shape = ("a non-empty string, an object with a content array, or a non-empty array of "
             "them" if many else "a non-empty string or an object with a content array")
    if value in ("", []) or (isinstance(value, list) and not many):
        return Refusal(INVALID_BODY, f"{param} must be {shape}.", param)
    listed = isinstance(value, list)
    for j, item in enumerate(value if listed else [value]):
        where = f"{param}[{j}]" if listed else param
        if isinstance(item, str):
            continue
        if not isinstance(item, dict) or not isinstance(item.get("content"), list):
            what = "a string or an object with a content array" if listed else shape
            return Refusal(INVALID_BODY, f"{where} must be {what}.", where)
        problem = check_parts(item["content"], f"{where}.content", media_domains,
                              text_types=TEXT_PART_TYPES, media_types=MEDIA_PART_TYPES)
        if problem:
            return problem
    return None


def _pair_problem(body: dict[str, Any]) -> Refusal:
    """Why a score body names no pair of SCORE_SIDES: no side at all, one side of a pair
    only, or sides of two pairs."""
    pairs = "; ".join(f"{a} and {b}" for a, b in SCORE_SIDES)
    names = {name for pair in SCORE_SIDES for name in pair}
    named = [name for name in body if name in names]
    if not named:
        return Refusal(MISSING_PARAMETER, "Missing the two sides to score; send one "
                       f"of these pairs: {pairs}.", "body.queries")
    partial = next((pair for pair in SCORE_SIDES if set(named) < set(pair)), None)
    if partial is not None:
        missing = next(name for name in partial if name not in named)
        return Refusal(MISSING_PARAMETER, f"Missing body.{missing}.", f"body.{missing}")
    return Refusal(INVALID_BODY, f"body.{named[0]} and body.{named[-1]} name sides of "
                   f"different pairs; send one of these pairs: {pairs}.", f"body.{named[-1]}")


def score_usage(prompt_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens,
            "completion_tokens": 0, "prompt_tokens_details": None,
            "completion_tokens_details": None}


def score_text(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, int | float) else "?"


class Scoring(Pooling):
    """What score and rerank share: two sides of inputs, each embedded on its own."""

    kind = "score"

    def prompts(self, body: dict[str, Any]) -> list[Any]:
        """The text of each input of its two sides (an embeddings model embeds each on
        its own)."""
        return ["\n".join(text_parts(content))
                for _, inputs in self.sides(body) for content in inputs]

    def prompt_values(self, body: dict[str, Any]) -> list[Any]:
        return [content for _, inputs in self.sides(body) for content in inputs]

    def echo(self, body: dict[str, Any], model: EchoModel) -> dict[str, Any]:
        """One score per pair, a single first input paired with each second one: the
        cosine similarity of their echo embeddings. Each input counts its words once, as
        vLLM embeds each input once."""
        (_, first), (_, second) = self.sides(body)
        texts = [" ".join(text_parts(content)) for content in first + second]
        for text in texts:
            if len(text.split()) > model.max_model_len:
                raise context_refusal(len(text.split()), model.max_model_len)
        prompt_tokens = sum(len(text.split()) for text in texts)
        queries, documents = texts[:len(first)], texts[len(first):]
        if len(queries) == 1:  # 1:N, as vLLM pairs them (else N:N)
            queries *= len(documents)
        scores = [cosine(echo_vector(q), echo_vector(d))
                  for q, d in zip(queries, documents, strict=True)]
        return self.respond(body, Pooled(model=body.get("model") or model.name,
                                         prompt_tokens=prompt_tokens, scores=scores,
                                         documents=second))

    def show_request(self, body: dict[str, Any]) -> str:
        """Each input of its two sides, one a line."""
        sides = self.sides(body)
        if not sides:
            return super().show_request(body)
        lines = []
        for name, inputs in sides:
            for i, content in enumerate(inputs):
                label = name if len(inputs) == 1 else f"{name}[{i}]"
                lines.append(f"{label}: {' '.join(text_parts(content))}")
        return "\n".join(lines)


class Score(Scoring):
    url = "/v1/score"
    fields = SCORING_FIELDS | {name for pair in SCORE_SIDES for name in pair}
    prompt_field = "queries"
    # ScoreRequest is a union of its forms of the two sides; validated as vLLM's run-batch
    # validates score lines.
    vllm = VllmServing("serving_scores", "vllm.entrypoints.pooling.scoring.protocol.ScoreRequest")

    def check_own(self, body: dict[str, Any], media_domains: Sequence[str]) -> Refusal | None:
        """Its two sides, named by one pair of SCORE_SIDES, paired 1:1, 1:N or N:N."""
        pair = score_pair(body)
        if pair is None:
            return _pair_problem(body)
        for name in pair:
            problem = check_inputs(body[name], f"body.{name}", media_domains)
            if problem:
                return problem
        (first, queries), (second, documents) = self.sides(body)
        if len(queries) != 1 and len(queries) != len(documents):
            return Refusal(INVALID_BODY,
                           f"body.{first} has {len(queries)} inputs and body.{second} "
                           f"{len(documents)}: send one {first} input (scored against each "
                           f"of body.{second}) or as many as body.{second} (scored in pairs).",
                           f"body.{second}")
        return None

    def sides(self, body: dict[str, Any]) -> list[tuple[str, list[Any]]]:
        pair = score_pair(body)
        return named_sides(body, pair) if pair else []

    def respond(self, body: dict[str, Any], result: Pooled) -> dict[str, Any]:
        """vLLM's score list."""
        return {"id": f"score-{uuid.uuid4().hex}", "object": "list",
                "created": int(time.time()), "model": result.model,
                "data": [{"index": i, "object": "score", "score": score}
                         for i, score in enumerate(result.scores)],
                "usage": score_usage(result.prompt_tokens)}

    def show_response(self, body: dict[str, Any]) -> str | None:
        """One score a pair."""
        data = body.get("data")
        if isinstance(data, list) and data and isinstance(data[0], dict) and "score" in data[0]:
            return "\n".join(f"pair {item.get('index')}: {score_text(item.get('score'))}"
                             for item in data if isinstance(item, dict))
        return None
