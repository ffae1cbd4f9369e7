"""/v1/embeddings: OpenAI's embeddings, on a pooling model."""

from __future__ import annotations

import time
import uuid
from typing import Any

from engine.endpoints.base import (
    EchoModel,
    Pooled,
    Pooling,
    VllmServing,
    context_refusal,
    echo_vector,
)
from engine.endpoints.completions import PlainPrompts


class Embeddings(PlainPrompts, Pooling):
    url = "/v1/embeddings"
    fields = frozenset({"input", "model", "dimensions", "encoding_format", "user",
                        "truncate_prompt_tokens"})
    kind = "embed"
    prompt_field = "input"
    vllm = VllmServing("serving_embedding",
                       "vllm.entrypoints.pooling.embed.protocol.EmbeddingRequest")

    def respond(self, body: dict[str, Any], result: Pooled) -> dict[str, Any]:
        return {
            "id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": result.model,
            "data": [{"index": i, "object": "embedding", "embedding": vector}
                     for i, vector in enumerate(result.embeddings)],
            "usage": {"prompt_tokens": result.prompt_tokens,
                      "total_tokens": result.prompt_tokens,
                      "completion_tokens": 0, "prompt_tokens_details": None},
        }

    def show_response(self, body: dict[str, Any]) -> str | None:
        """The embedding's size."""
        data = body.get("data")
        if isinstance(data, list) and data and isinstance(data[0], dict):
            embedding = data[0].get("embedding")
            if isinstance(embedding, list):
                return f"embedding of {len(embedding)} dimensions ({len(data)} inputs)"
        return None

    def echo(self, body: dict[str, Any], model: EchoModel) -> dict[str, Any]:
        """An echo embedding (`echo_vector`) per input; its words are its tokens."""
        inputs = body["input"]
        if isinstance(inputs, str):
            inputs = [inputs]
        vectors = []
        prompt_tokens = 0
        for text in inputs:
            tokens = len(text.split())
            if tokens > model.max_model_len:
                raise context_refusal(tokens, model.max_model_len)
            prompt_tokens += tokens
            vectors.append(echo_vector(text))
        return self.respond(body, Pooled(model=body.get("model") or model.name,
                                         prompt_tokens=prompt_tokens, embeddings=vectors))
