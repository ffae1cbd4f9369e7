"""/v1/messages: Anthropic's Messages API (a Message Batch's requests), served through
vLLM's Anthropic layer, which renders the request through the chat one: every model
serving chat serves it. Its answers and errors are Anthropic's shapes."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from engine.endpoints.base import (
    INVALID_BODY,
    INVALID_PARAMETER,
    MISSING_PARAMETER,
    Endpoint,
    Generation,
    Refusal,
    TemplateInput,
    VllmServing,
    dicts,
    is_int,
    show_messages,
    text_parts,
    tool_call,
)
from engine.endpoints.media import media_problem

# Anthropic's error types by HTTP status (its documented "HTTP errors"); any other status
# is the nearest of them: another 4xx an invalid request, another 5xx an API error.
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}
# Documented Messages API parameters no model here can honour: a clear refusal each.
UNSUPPORTED = frozenset({
    "container", "mcp_servers", "context_management", "inference_geo", "speed"})
BLOCK_TYPES = frozenset({"text", "image", "tool_use", "tool_result", "thinking",
                         "redacted_thinking"})


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    """An Anthropic error object: {"type": "error", "error": {"type", "message"}}, the body
    of the API's refusals and of an `errored` batch result alike."""
    kind = ANTHROPIC_ERROR_TYPES.get(status) or (
        "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _check_blocks(content: Any, param: str, media_domains: Sequence[str], *, required: bool,
                  types: frozenset[str] = BLOCK_TYPES) -> Refusal | None:
    if content is None and not required:
        return None
    if isinstance(content, str):
        return None
    if not isinstance(content, list):
        return Refusal(INVALID_BODY, f"{param} must be a string or an array of "
                       "content blocks.", param)
    for j, block in enumerate(content):
        where = f"{param}[{j}]"
        if not isinstance(block, dict) or block.get("type") not in types:
            return Refusal(INVALID_PARAMETER,
                           f"{where}.type must be one of {', '.join(sorted(types))}.",
                           f"{where}.type")
        if block["type"] == "text" and not isinstance(block.get("text"), str):
            return Refusal(INVALID_BODY, f"{where}.text must be a string.", f"{where}.text")
        if block["type"] == "image":
            problem = media_problem(block, where, media_domains)
            if problem:
                return problem
        if block["type"] == "tool_result" and isinstance(block.get("content"), list):
            # Its blocks reach the model too (an image there is fetched like any other).
            problem = _check_blocks(block["content"], f"{where}.content", media_domains,
                                    required=False, types=frozenset({"text", "image"}))
            if problem:
                return problem
    return None


class Messages(Endpoint):
    url = "/v1/messages"
    # The request parameters vLLM's Anthropic layer honours (or, as metadata and
    # service_tier, that do not change the answer). Those it would drop or cannot serve are
    # refused by name (UNSUPPORTED); vLLM's own extra fields (kv_transfer_params,
    # vllm_xargs, cache_salt, chat_template_kwargs...) are not Anthropic's and are refused
    # as any unknown field.
    fields = frozenset({
        "model", "messages", "max_tokens", "system", "temperature", "top_p", "top_k",
        "stop_sequences", "metadata", "stream", "tools", "tool_choice", "thinking",
        "output_config", "service_tier"})
    unsupported = UNSUPPORTED
    max_temperature = 1  # Anthropic's range is 0 to 1
    kind = "chat"
    prompt_field = "messages"
    # vLLM's Anthropic request model has no `priority` field (it would be ignored anyway).
    takes_priority = False
    # vLLM's Anthropic layer renders a Message as a chat completion.
    served_through = "/v1/chat/completions"
    # As vLLM's router writes a Message: unset optional fields left out.
    vllm = VllmServing("anthropic_serving_messages",
                       "vllm.entrypoints.anthropic.protocol.AnthropicMessagesRequest",
                       "create_messages", {"exclude_none": True})

    def check_own(self, body: dict[str, Any], media_domains: Sequence[str]) -> Refusal | None:
        """max_tokens required, user/assistant messages whose content is a string or blocks
        of its types, a system string or text blocks, top_k and stop_sequences typed.
        Images are media parts: URLs only from allowed domains."""
        if body.get("max_tokens") is None:
            return Refusal(MISSING_PARAMETER, "Missing body.max_tokens.", "body.max_tokens")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return Refusal(INVALID_BODY, "body.messages must be a non-empty array.",
                           "body.messages")
        for i, message in enumerate(messages):
            param = f"body.messages[{i}]"
            if not isinstance(message, dict) or message.get("role") not in ("user",
                                                                            "assistant"):
                return Refusal(INVALID_BODY,
                               f"{param} must be an object with role 'user' or 'assistant' "
                               "(the system prompt is body.system).", f"{param}.role")
            problem = _check_blocks(message.get("content"), f"{param}.content", media_domains,
                                    required=True)
            if problem:
                return problem
        problem = _check_blocks(body.get("system"), "body.system", media_domains,
                                required=False, types=frozenset({"text"}))
        if problem:
            return problem
        top_k = body.get("top_k")
        if top_k is not None and (not is_int(top_k) or top_k < 0):
            return Refusal(INVALID_PARAMETER, "body.top_k must be a non-negative integer.",
                           "body.top_k")
        stops = body.get("stop_sequences")
        if stops is not None and (not isinstance(stops, list)
                                  or not all(isinstance(s, str) for s in stops)):
            return Refusal(INVALID_PARAMETER, "body.stop_sequences must be an array of "
                           "strings.", "body.stop_sequences")
        metadata = body.get("metadata")
        if metadata is not None and not isinstance(metadata, dict):
            return Refusal(INVALID_PARAMETER, "body.metadata must be an object.",
                           "body.metadata")
        return None

    def messages(self, body: dict[str, Any]) -> list[Any]:
        """Its `system` first, as one system message (vLLM's Anthropic layer renders it so,
        its text blocks joined as they are), then its `messages`."""
        system = body.get("system")
        head = [{"role": "system", "content": "".join(text_parts(system))}] if system else []
        messages = body.get("messages")
        return head + (messages if isinstance(messages, list) else [])

    def template_input(self, body: dict[str, Any]) -> TemplateInput:
        """As vLLM's Anthropic layer turns it into a chat request: its system message, each
        message's text and thinking blocks as its text, its `tool_use` blocks as tool
        calls, each `tool_result` as a tool message of its own, and its `tools` as
        function tools (`input_schema` their parameters)."""
        shown: list[dict[str, Any]] = []
        for message in dicts(self.messages(body)):
            content = message.get("content")
            blocks = dicts(content)
            texts = text_parts(content) + [b["thinking"] for b in blocks
                                           if isinstance(b.get("thinking"), str)]
            turn: dict[str, Any] = {"role": str(message.get("role", "user")),
                                    "content": "\n".join(texts)}
            calls = [tool_call(b.get("id"), b.get("name"), b.get("input"))
                     for b in blocks if b.get("type") == "tool_use"]
            if calls:
                turn["tool_calls"] = calls
            shown.append(turn)
            shown += [{"role": "tool", "tool_call_id": str(b.get("tool_use_id") or ""),
                       "content": "\n".join(text_parts(b.get("content")))}
                      for b in blocks if b.get("type") == "tool_result"]
        tools = [{"type": "function", "function": {
            "name": t.get("name"), "description": t.get("description"),
            "parameters": t.get("input_schema")}} for t in dicts(body.get("tools"))]
        return TemplateInput(shown, tools)

    def error_body(self, status: int, openai: dict[str, Any]) -> dict[str, Any]:
        return anthropic_error(status, openai["error"]["message"])

    def output_texts(self, body: dict[str, Any]) -> list[tuple[str, str | None]]:
        """Its text blocks; stop_reason "max_tokens" is the length stop."""
        finish = "length" if body.get("stop_reason") == "max_tokens" else body.get("stop_reason")
        return [(" ".join(text_parts(body.get("content"))), finish)]

    def usage(self, body: dict[str, Any]) -> tuple[int, int, int]:
        """A Message counts its prompt in three parts: `input_tokens` (not from the cache),
        `cache_read_input_tokens` (from it) and `cache_creation_input_tokens`."""
        usage = body.get("usage") or {}
        cached = int(usage.get("cache_read_input_tokens") or 0)
        prompt = (int(usage.get("input_tokens") or 0) + cached
                  + int(usage.get("cache_creation_input_tokens") or 0))
        return prompt, int(usage.get("output_tokens") or 0), cached

    def respond(self, body: dict[str, Any], result: Generation) -> dict[str, Any]:
        """A Message, as vLLM's Anthropic layer answers (its `usage` without the cache
        fields: the echo engine has no prefix cache; a reasoning model's thinking as a
        thinking block, its tokens only in output_tokens: Anthropic's usage has no count
        of its own for them)."""
        thinking = [{"type": "thinking", "thinking": result.reasoning,
                     "signature": uuid.uuid4().hex}] if result.reasoning else []
        return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
                "content": [*thinking, {"type": "text", "text": result.text}],
                "model": result.model,
                "stop_reason": "max_tokens" if result.cut else "end_turn",
                "stop_sequence": None,
                "usage": {"input_tokens": result.prompt_tokens,
                          "output_tokens": result.output_tokens}}

    def show_request(self, body: dict[str, Any]) -> str:
        """Its system prompt first, then its messages."""
        if isinstance(body.get("messages"), list):
            return show_messages(self.messages(body))
        return super().show_request(body)

    def show_response(self, body: dict[str, Any]) -> str | None:
        return " ".join(text_parts(body.get("content"))) if body.get("type") == "message" else None
