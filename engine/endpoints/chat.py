"""/v1/chat/completions: OpenAI's chat completions."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

from engine.endpoints.base import (
    INVALID_BODY,
    VLLM_SAMPLING_FIELDS,
    Endpoint,
    Generation,
    Refusal,
    TemplateInput,
    VllmServing,
    dicts,
)
from engine.endpoints.media import check_parts

# Content part types of a chat message: OpenAI's, plus vLLM's video_url and audio_url.
# Other types vLLM reads (image_embeds, prompt_embeds, image_pil...) are not documented
# request content and are refused.
TEXT_PART_TYPES = frozenset({"text", "refusal"})
MEDIA_PART_TYPES = frozenset({"image_url", "input_audio", "file", "video_url", "audio_url"})


def check_messages(messages: Any, media_domains: Sequence[str]) -> Refusal | None:
    if not isinstance(messages, list) or not messages:
        return Refusal(INVALID_BODY, "body.messages must be a non-empty array.",
                       "body.messages")
    for i, message in enumerate(messages):
        param = f"body.messages[{i}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            return Refusal(INVALID_BODY, f"{param} must be an object with a role.", param)
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            return Refusal(INVALID_BODY,
                           f"{param}.content must be a string or an array of parts.",
                           f"{param}.content")
        if isinstance(content, list):
            problem = check_parts(content, f"{param}.content", media_domains,
                                  text_types=TEXT_PART_TYPES, media_types=MEDIA_PART_TYPES)
            if problem:
                return problem
    return None


def openai_common(result: Generation) -> dict[str, Any]:
    """The fields a chat.completion and a text_completion share: with a reasoning parser,
    vLLM's usage counts the reasoning tokens of its completion tokens (all choices)."""
    completion_tokens = result.output_tokens * result.n
    usage: dict[str, Any] = {"prompt_tokens": result.prompt_tokens,
                             "total_tokens": result.prompt_tokens + completion_tokens,
                             "completion_tokens": completion_tokens,
                             "prompt_tokens_details": None}
    if result.reasoning is not None:
        usage["completion_tokens_details"] = {
            "reasoning_tokens": result.reasoning_tokens * result.n}
    return {"created": int(time.time()), "model": result.model, "usage": usage}


class Chat(Endpoint):
    url = "/v1/chat/completions"
    # OpenAI's request parameters, plus vLLM's documented extra sampling parameters.
    fields = frozenset({
        "messages", "model", "audio", "frequency_penalty", "function_call", "functions",
        "logit_bias", "logprobs", "max_completion_tokens", "max_tokens", "metadata",
        "modalities", "n", "parallel_tool_calls", "prediction", "presence_penalty",
        "prompt_cache_key", "reasoning_effort", "response_format", "safety_identifier",
        "seed", "service_tier", "stop", "store", "stream", "stream_options", "temperature",
        "tool_choice", "tools", "top_logprobs", "top_p", "user", "verbosity",
        "web_search_options"}) | VLLM_SAMPLING_FIELDS
    kind = "chat"
    prefix_grouped = True
    prompt_field = "messages"
    limit_field = "max_completion_tokens"
    droppable = ("functions", "function_call", "modalities", "audio", "web_search_options")
    vllm = VllmServing("openai_serving_chat",
                       "vllm.entrypoints.openai.chat_completion.protocol.ChatCompletionRequest",
                       "create_chat_completion")

    def check_own(self, body: dict[str, Any], media_domains: Sequence[str]) -> Refusal | None:
        return check_messages(body.get("messages"), media_domains)

    def messages(self, body: dict[str, Any]) -> list[Any]:
        # The list itself, not a copy: validation calls this for every line (a body not
        # yet validated may hold other items there).
        messages = body.get("messages")
        return messages if isinstance(messages, list) else []

    def template_input(self, body: dict[str, Any]) -> TemplateInput:
        """Its messages and `tools`, and the older `functions` as tools (vLLM renders
        either where its request model keeps them)."""
        shown = super().template_input(body)
        tools = dicts(body.get("tools")) + [{"type": "function", "function": f}
                                            for f in dicts(body.get("functions"))]
        return shown._replace(tools=tools)

    def prompt_text(self, body: dict[str, Any]) -> tuple[str, int]:
        messages = body["messages"]
        try:  # the common case, every content a string
            text = "\n".join([message["content"] for message in messages])
            return text, len(text) - len(messages) + 1
        except (KeyError, TypeError):
            return super().prompt_text(body)

    def json_format(self, body: dict[str, Any]) -> Any:
        return body.get("response_format")

    def output_texts(self, body: dict[str, Any]) -> list[tuple[str, str | None]]:
        return [((choice.get("message") or {}).get("content") or "", choice.get("finish_reason"))
                for choice in body.get("choices") or ()]

    def respond(self, body: dict[str, Any], result: Generation) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": result.text, "refusal": None,
                                   "tool_calls": []}
        if result.reasoning is not None:  # vLLM's field beside the answer's content
            message["reasoning"] = result.reasoning or None
        finish = "length" if result.cut else "stop"
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                **openai_common(result), "choices": [
                    {"index": i, "message": message, "logprobs": None,
                     "finish_reason": finish, "stop_reason": None}
                    for i in range(result.n)]}

    def show_response(self, body: dict[str, Any]) -> str | None:
        """The first choice's message."""
        choices = body.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            message = choices[0].get("message")
            if isinstance(message, dict):
                return str(message.get("content") or "")
        return None
