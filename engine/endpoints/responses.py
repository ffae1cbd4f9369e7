"""/v1/responses: OpenAI's Responses API, one request at a time (no stored state)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from engine.endpoints.base import (
    INVALID_BODY,
    INVALID_PARAMETER,
    Endpoint,
    Generation,
    Refusal,
    TemplateInput,
    VllmServing,
    dicts,
    show_messages,
    template_message,
    text_parts,
    tool_call,
)
from engine.endpoints.media import check_parts

# Responses parameters that need state kept between requests or a background job, which a
# batch does not have: a batch's answers live in its output file only, never as stored
# responses (GET /v1/responses/{id} is not served), so each is refused, naming it, rather
# than run as if it were not set. `store` is refused only when sent as true: OpenAI's
# default is true, but a line that does not mention it asks for nothing a batch cannot do
# (its answer is in the output file), while an explicit true says the caller means to
# retrieve or continue the response later, which would then fail far from the cause.
STATEFUL = {
    "store": "Responses are not stored in a batch (its output file holds them); send "
             "store: false or leave it out.",
    "background": "Background mode is not available in a batch (a batch already runs in "
                  "the background).",
    "previous_response_id": "A batch request cannot continue a stored response (responses "
                            "are not stored); send the earlier turns in input.",
    "conversation": "A batch request cannot belong to a stored conversation; send the "
                    "earlier turns in input.",
    "prompt": "Stored prompt templates are not available here; send the prompt in input "
              "and instructions.",
}
# Input item types the engine renders into the prompt; the others reference stored items
# or the calls of built-in tools this service does not run.
ITEM_TYPES = frozenset({"message", "function_call", "function_call_output", "reasoning"})
# Content part types of a Responses message, as chat's TEXT_PART_TYPES / MEDIA_PART_TYPES.
TEXT_PART_TYPES = frozenset({"input_text", "output_text", "refusal"})
MEDIA_PART_TYPES = frozenset({"input_image", "input_file", "input_audio"})


def _check_input_items(items: list[Any], media_domains: Sequence[str]) -> Refusal | None:
    for i, item in enumerate(items):
        param = f"body.input[{i}]"
        if not isinstance(item, dict):
            return Refusal(INVALID_BODY, f"{param} must be an object.", param)
        kind = item.get("type", "message" if "role" in item else None)
        if kind not in ITEM_TYPES:
            return Refusal(INVALID_PARAMETER,
                           f"{param}.type must be one of "
                           f"{', '.join(sorted(ITEM_TYPES))} (items that "
                           "reference stored items or built-in tool calls are not "
                           "available here).", f"{param}.type")
        if kind == "function_call_output":
            # Its output becomes a tool message's content: parts there are fetched as a
            # message's are (an input_image's image_url included).
            problem = _check_parts(item.get("output"), f"{param}.output", media_domains)
            if problem:
                return problem
            continue
        if kind != "message":
            continue
        content = item.get("content")
        if not isinstance(item.get("role"), str) or not isinstance(content, str | list):
            return Refusal(INVALID_BODY,
                           f"{param} must have a role and a content string or array.", param)
        problem = _check_parts(content, f"{param}.content", media_domains)
        if problem:
            return problem
    return None


def _check_parts(value: Any, param: str, media_domains: Sequence[str]) -> Refusal | None:
    """A Responses message's parts (a list; a string has none), as check_parts reads them."""
    if not isinstance(value, list):
        return None
    return check_parts(value, param, media_domains, text_types=TEXT_PART_TYPES,
                       media_types=MEDIA_PART_TYPES)


def output_text(body: dict[str, Any]) -> str:
    """The text of a Responses `response`: its output messages' output_text parts, joined
    (reasoning and function calls are not the answer's text)."""
    parts = []
    for item in body.get("output") or ():
        if isinstance(item, dict) and item.get("type") == "message":
            for part in item.get("content") or ():
                if isinstance(part, dict) and part.get("type") == "output_text":
                    parts.append(str(part.get("text") or ""))
    return "".join(parts)


class Responses(Endpoint):
    url = "/v1/responses"
    fields = frozenset({
        "input", "model", "background", "conversation", "include", "instructions",
        "max_output_tokens", "max_tool_calls", "metadata", "parallel_tool_calls",
        "previous_response_id", "prompt", "prompt_cache_key", "prompt_cache_retention",
        "reasoning", "safety_identifier", "service_tier", "store", "stream",
        "stream_options", "temperature", "text", "tool_choice", "tools", "top_logprobs",
        "top_p", "truncation", "user",
        # vLLM's sampling extras on its ResponsesRequest (only those: it would drop the
        # others).
        "frequency_penalty", "presence_penalty", "logit_bias", "seed", "stop", "top_k",
        "min_p", "repetition_penalty", "stop_token_ids", "include_stop_str_in_output",
        "ignore_eos", "skip_special_tokens"})
    limit_field = "max_output_tokens"
    kind = "chat"
    prefix_grouped = True
    prompt_field = "input"
    # Dumped as vLLM's /v1/responses route writes it: by alias (text.format's `schema` is
    # `schema_` on the model) and as JSON (its output items are models).
    vllm = VllmServing("openai_serving_responses",
                       "vllm.entrypoints.openai.responses.protocol.ResponsesRequest",
                       "create_responses", {"mode": "json", "by_alias": True})

    def check_own(self, body: dict[str, Any], media_domains: Sequence[str]) -> Refusal | None:
        """Its input, the state it may not ask for, its tools and its text format."""
        for name, reason in STATEFUL.items():
            value = body.get(name)
            if value is None or value is False:  # not asked for (true in any spelling is)
                continue
            return Refusal(INVALID_PARAMETER, f"body.{name} is not supported: {reason}",
                           f"body.{name}")
        value = body.get("input")
        if not isinstance(value, str | list) or value in ("", []):
            return Refusal(INVALID_BODY, "body.input must be a non-empty string or array.",
                           "body.input")
        if isinstance(value, list):
            problem = _check_input_items(value, media_domains)
            if problem:
                return problem
        if body.get("instructions") is not None and not isinstance(body["instructions"], str):
            return Refusal(INVALID_BODY, "body.instructions must be a string.",
                           "body.instructions")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            return Refusal(INVALID_BODY, "body.tools must be an array.", "body.tools")
        for i, tool in enumerate(tools or ()):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                # Built-in tools (web_search, file_search, code_interpreter, computer_use,
                # mcp, image_generation...) run on OpenAI's side; no engine here runs them.
                return Refusal(INVALID_PARAMETER,
                               f"body.tools[{i}]: {str(kind)[:100]} tools are not available "
                               "here; only function tools (type: function) are accepted.",
                               f"body.tools[{i}].type")
        text = body.get("text")
        if text is not None:
            if not isinstance(text, dict):
                return Refusal(INVALID_BODY, "body.text must be an object.", "body.text")
            fmt = text.get("format")
            if fmt is None:
                return None
            if not isinstance(fmt, dict) or fmt.get("type") not in (
                    "text", "json_object", "json_schema"):
                return Refusal(INVALID_PARAMETER,
                               "body.text.format must be an object whose type is text, "
                               "json_object or json_schema.", "body.text.format")
            if fmt["type"] == "json_schema" and not isinstance(fmt.get("schema"), dict):
                # Without it vLLM would run the request unconstrained.
                return Refusal(INVALID_PARAMETER,
                               "body.text.format.schema must be a JSON Schema object.",
                               "body.text.format.schema")
        return None

    def messages(self, body: dict[str, Any]) -> list[Any]:
        """Built as vLLM builds them: `instructions` as a system message, a string `input`
        as one user message, else its items with a role (messages), and each
        function_call_output as a tool message carrying its output; function calls and
        reasoning items carry no prompt text."""
        found: list[Any] = []
        instructions = body.get("instructions")
        if isinstance(instructions, str) and instructions:
            found.append({"role": "system", "content": instructions})
        value = body.get("input")
        if isinstance(value, str):
            found.append({"role": "user", "content": value})
        elif isinstance(value, list):
            for item in value:
                if not isinstance(item, dict):
                    continue
                if isinstance(item.get("role"), str):
                    found.append({"role": item["role"], "content": item.get("content")})
                elif item.get("type") in ("function_call_output", "custom_tool_call_output"):
                    found.append({"role": "tool", "content": item.get("output")})
        return found

    def template_input(self, body: dict[str, Any]) -> TemplateInput:
        """As vLLM turns it into chat messages: its messages (`messages`), each
        `function_call` item as an assistant's tool call, the texts of reasoning items as
        an assistant's text, and its function tools in chat's shape."""
        shown: list[dict[str, Any]] = []
        value = body.get("input")
        items = dicts(value) if isinstance(value, list) else []
        messages = iter(self.messages(body))
        if isinstance(body.get("instructions"), str) and body["instructions"]:
            shown.append(template_message(next(messages)))
        if isinstance(value, str):
            shown.append(template_message(next(messages)))
        for item in items:
            kind = item.get("type")
            if isinstance(item.get("role"), str) or kind in (
                    "function_call_output", "custom_tool_call_output"):
                shown.append(template_message(next(messages)))
            elif kind in ("function_call", "custom_tool_call"):
                shown.append({"role": "assistant", "content": "", "tool_calls": [tool_call(
                    item.get("call_id"), item.get("name"),
                    item.get("arguments", item.get("input")))]})
            elif kind == "reasoning":
                texts = [t for part in ("summary", "content")
                         for t in text_parts(item.get(part))]
                shown.append({"role": "assistant", "content": "\n".join(texts)})
        tools = [{"type": "function", "function": {
            "name": t.get("name"), "description": t.get("description"),
            "parameters": t.get("parameters")}} for t in dicts(body.get("tools"))]
        return TemplateInput(shown, tools)

    def engine_body(self, body: dict[str, Any], *,
                    options: Mapping[str, Any] | None = None) -> dict[str, Any]:
        # The batch line's body is the whole request: no stored response, no background run
        # (validation refuses both), so the engine answers the Response object itself,
        # never a stream or a queued stub. `store` is OpenAI's default (true) on vLLM's
        # request model too: turned off, so vLLM keeps nothing of a request after
        # answering it even where an operator set VLLM_ENABLE_RESPONSES_API_STORE (its
        # store never forgets: a worker running millions of requests would grow without
        # bound).
        return {**body, "store": False}

    def calls_functions(self, body: dict[str, Any]) -> bool:
        return bool(body.get("tools")) and body.get("tool_choice", "auto") != "none"

    def json_format(self, body: dict[str, Any]) -> Any:
        """Its `text.format` (chat's types; the schema sits in the format itself)."""
        text = body.get("text")
        return text.get("format") if isinstance(text, dict) else None

    def output_texts(self, body: dict[str, Any]) -> list[tuple[str, str | None]]:
        """The one answer: "length" when it stopped at max_output_tokens."""
        stopped = (body.get("incomplete_details") or {}).get("reason")
        return [(output_text(body), "length" if stopped == "max_output_tokens" else None)]

    def usage(self, body: dict[str, Any]) -> tuple[int, int, int]:
        """Its usage names them input_tokens, output_tokens and
        `input_tokens_details.cached_tokens`."""
        usage = body.get("usage") or {}
        details = usage.get("input_tokens_details") or {}
        return (int(usage.get("input_tokens") or 0), int(usage.get("output_tokens") or 0),
                int(details.get("cached_tokens") or 0))

    def reasoning_tokens(self, body: dict[str, Any]) -> int:
        """Its usage's `output_tokens_details.reasoning_tokens`."""
        details = (body.get("usage") or {}).get("output_tokens_details") or {}
        return int(details.get("reasoning_tokens") or 0)

    def respond(self, body: dict[str, Any], result: Generation) -> dict[str, Any]:
        """A `response` as vLLM's serving layer writes it (the fields readers use): a
        reasoning item first when the model reasoned, then one output message,
        "incomplete" when cut at max_output_tokens."""
        content: list[dict[str, Any]] = [{"type": "output_text", "text": result.text,
                                          "annotations": [], "logprobs": None}]
        tokens = result.output_tokens * result.n
        reasoning: list[dict[str, Any]] = [{
            "id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": result.reasoning}],
            "encrypted_content": None, "status": None}] if result.reasoning else []
        return {
            "id": f"resp_{uuid.uuid4().hex}", "object": "response",
            "created_at": int(time.time()), "model": result.model,
            "status": "incomplete" if result.cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if result.cut else None,
            "instructions": body.get("instructions"), "metadata": body.get("metadata"),
            "background": False, "max_output_tokens": body.get("max_output_tokens"),
            "previous_response_id": None, "temperature": body.get("temperature", 1.0),
            "top_p": body.get("top_p", 1.0), "text": body.get("text"),
            "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice", "auto"),
            "parallel_tool_calls": True, "truncation": body.get("truncation", "disabled"),
            "service_tier": "auto", "user": body.get("user"),
            "output": [*reasoning, {"id": f"msg_{uuid.uuid4().hex}", "type": "message",
                                    "role": "assistant", "status": "completed",
                                    "content": content if result.text else []}],
            "usage": {"input_tokens": result.prompt_tokens, "output_tokens": tokens,
                      "total_tokens": result.prompt_tokens + tokens,
                      "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens_details": {
                          "reasoning_tokens": result.reasoning_tokens * result.n}},
        }

    def show_request(self, body: dict[str, Any]) -> str:
        return show_messages(self.messages(body))

    def show_response(self, body: dict[str, Any]) -> str | None:
        return output_text(body) if body.get("object") == "response" else None
