"""/v1/rerank: vLLM's rerank API. A request orders documents by their relevance to one
query, on a pooling model (see score.py for how pairs are scored)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from engine.endpoints.base import (
    INVALID_PARAMETER,
    MISSING_PARAMETER,
    Pooled,
    Refusal,
    VllmServing,
    is_int,
    text_parts,
)
from engine.endpoints.score import (
    SCORING_FIELDS,
    Scoring,
    check_inputs,
    named_sides,
    score_text,
)


class Rerank(Scoring):
    url = "/v1/rerank"
    fields = SCORING_FIELDS | {"query", "documents", "top_n"}
    prompt_field = "query"
    vllm = VllmServing("serving_scores",
                       "vllm.entrypoints.pooling.scoring.protocol.RerankRequest")

    def check_own(self, body: dict[str, Any], media_domains: Sequence[str]) -> Refusal | None:
        """Its query (one input) and documents, and its top_n."""
        for name in ("query", "documents"):
            if body.get(name) is None:
                return Refusal(MISSING_PARAMETER, f"Missing body.{name}.", f"body.{name}")
        problem = (check_inputs(body["query"], "body.query", media_domains, many=False)
                   or check_inputs(body["documents"], "body.documents", media_domains))
        if problem:
            return problem
        top_n = body.get("top_n")
        if top_n is not None and (not is_int(top_n) or top_n < 1):
            return Refusal(INVALID_PARAMETER, "body.top_n must be a positive integer "
                           "(leave it out for every document).", "body.top_n")
        return None

    def sides(self, body: dict[str, Any]) -> list[tuple[str, list[Any]]]:
        return named_sides(body, ("query", "documents"))

    def respond(self, body: dict[str, Any], result: Pooled) -> dict[str, Any]:
        """The documents by relevance (ties in document order, as vLLM's stable sort), the
        first `top_n`."""
        scores, documents = result.scores, result.documents
        ranked = sorted(range(len(scores)), key=lambda i: -scores[i])
        results = [{"index": i, "document": {"text": documents[i], "multi_modal": None}
                    if isinstance(documents[i], str)
                    else {"text": None, "multi_modal": documents[i]},
                    "relevance_score": scores[i]}
                   for i in ranked[:body.get("top_n") or len(ranked)]]
        return {"id": f"score-{uuid.uuid4().hex}", "model": result.model, "results": results,
                "usage": {"prompt_tokens": result.prompt_tokens,
                          "total_tokens": result.prompt_tokens}}

    def show_response(self, body: dict[str, Any]) -> str | None:
        """The documents by relevance, each with its score."""
        results = body.get("results")
        if not isinstance(results, list):
            return None
        ranked = []
        for result in results:
            if not isinstance(result, dict):
                continue
            document = result.get("document")
            # A document of content parts comes back as `multi_modal`: its text parts.
            text = (document.get("text") or " ".join(text_parts(document.get("multi_modal")))
                    if isinstance(document, dict) else "")
            ranked.append(f"{score_text(result.get('relevance_score'))} "
                          f"documents[{result.get('index')}]" + (f": {text}" if text else ""))
        return "\n".join(ranked)
