"""/v1/completions: OpenAI's (legacy) completions of a plain prompt."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from engine.endpoints.base import (
    INVALID_BODY,
    VLLM_SAMPLING_FIELDS,
    EchoModel,
    Endpoint,
    Generation,
    Refusal,
    VllmServing,
    text_parts,
)
from engine.endpoints.chat import openai_common


def plain_prompts(value: Any) -> list[Any]:
    """The prompts of a completions `prompt` or an embeddings `input`: a string or one list
    of token ids is one prompt, another list holds several."""
    if isinstance(value, str) or (isinstance(value, list) and value
                                  and all(isinstance(t, int) for t in value)):
        return [value]
    return list(value) if isinstance(value, list) else []


class PlainPrompts(Endpoint):
    """An endpoint whose prompt field (`prompt_field`) holds plain prompts: a string, token
    ids, or a list of either."""

    def check_own(self, body: dict[str, Any], media_domains: Sequence[str]) -> Refusal | None:
        value = body.get(self.prompt_field)
        if not isinstance(value, str | list) or value in ("", []):
            param = f"body.{self.prompt_field}"
            return Refusal(INVALID_BODY, f"{param} must be a non-empty string or array.", param)
        return None

    def prompts(self, body: dict[str, Any]) -> list[Any]:
        return plain_prompts(body.get(self.prompt_field))

    def prompt_values(self, body: dict[str, Any]) -> list[Any]:
        return [body.get(self.prompt_field)]

    def echo_words(self, body: dict[str, Any],
                   model: EchoModel) -> tuple[int, list[str], list[str] | None]:
        """The prompt's own words (an adapter's lead in front), never a thought."""
        words = " ".join(text_parts(body[self.prompt_field])).split()
        if model.adapter:
            words.insert(0, model.lead)
        return len(words), words, None


class Completions(PlainPrompts):
    url = "/v1/completions"
    fields = frozenset({
        "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs",
        "max_tokens", "n", "presence_penalty", "seed", "stop", "stream", "stream_options",
        "suffix", "temperature", "top_p", "user"}) | VLLM_SAMPLING_FIELDS
    kind = "generate"
    prompt_field = "prompt"
    droppable = ("best_of",)
    # OpenAI's default for a completion that names no max_tokens (vLLM's as well).
    default_limit = 16
    vllm = VllmServing("openai_serving_completion",
                       "vllm.entrypoints.openai.completion.protocol.CompletionRequest",
                       "create_completion")

    def answers(self, body: dict[str, Any]) -> int:
        """n answers (best_of generated, where an engine honours it) for each prompt."""
        best_of = body.get("best_of")
        each = max(super().answers(body), best_of if isinstance(best_of, int) else 1)
        return each * max(len(self.prompts(body)), 1)

    def output_texts(self, body: dict[str, Any]) -> list[tuple[str, str | None]]:
        return [(choice.get("text") or "", choice.get("finish_reason"))
                for choice in body.get("choices") or ()]

    def respond(self, body: dict[str, Any], result: Generation) -> dict[str, Any]:
        finish = "length" if result.cut else "stop"
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                **openai_common(result),
                "choices": [{"index": i, "text": result.text, "logprobs": None,
                             "finish_reason": finish, "stop_reason": None}
                            for i in range(result.n)]}

    def show_response(self, body: dict[str, Any]) -> str | None:
        """The first choice's text."""
        choices = body.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            return str(choices[0].get("text") or "")
        return None
