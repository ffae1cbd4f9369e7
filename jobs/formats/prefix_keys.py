"""Prefix keys: which requests of a batch share a long prompt prefix.

vLLM's prefix cache keys its KV blocks on the prompt's leading tokens, and the prompt of a
chat request is its chat template rendered over (tools, messages). Two requests whose
rendering starts the same way share those blocks. Rendering and tokenizing every line of a
million-line file at validation would cost more than validating it, so the key is taken
from what decides the rendered prefix, in the order the template writes it:

- the model, the tools and template options (they are written before the messages), and
  `cache_salt` (vLLM keeps salted prefixes apart);
- then either every message before the last one (a system prompt, instructions, few-shot
  turns: the shared context of classification, extraction and translation files), when
  that context is at least PREFIX_MIN_CHARS long;
- or else, for one long message that starts with shared instructions, its first
  PREFIX_BLOCK_CHARS characters.

Sampling parameters change no prefill: vLLM computes and caches the prompt's KV the same
whatever the temperature or max_tokens. Only chat and Responses requests get a key (a
Responses body's messages are its endpoint's `messages`: its instructions first);
completions and embeddings run in file order as before.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from engine.endpoints import endpoint, text_parts
from jobs.formats.wire import RequestLine

# A context shorter than this (~64 tokens) is not worth grouping for.
PREFIX_MIN_CHARS = 256
# The leading characters of a lone long message that stand for its prefix (~256 tokens).
PREFIX_BLOCK_CHARS = 1024
# Contexts are hashed up to this many characters: requests that agree that far share a
# prefix long enough to group by, whatever follows.
PREFIX_MAX_CHARS = 16384

# Body fields the chat template renders before the messages, or that change the cache key.
# (`reasoning` is a Responses body's: its effort is a template option.)
_RENDERED_FIELDS = ("tools", "reasoning", "chat_template", "chat_template_kwargs",
                    "documents", "add_generation_prompt", "continue_final_message",
                    "cache_salt")


@dataclass(frozen=True)
class PrefixKey:
    digest: int  # 64 bits, for compact arrays at validation; see prefix_key
    chars: int  # characters of the shared text the key stands for


def _message_text(message: object) -> str:
    if not isinstance(message, dict):
        return ""
    content = message.get("content")
    if type(content) is not str:
        content = "\x1e".join(text_parts(content))
    extra = ""
    if "tool_calls" in message or "name" in message or "tool_call_id" in message:
        extra = json.dumps([message.get("name"), message.get("tool_call_id"),
                            message.get("tool_calls")], sort_keys=True)
    return f"{message.get('role')}\x1f{extra}\x1f{content}\x1d"


def prefix_key(request: RequestLine) -> PrefixKey | None:
    """The key of the prompt prefix this request shares with others like it, or None when
    it has none worth grouping by (see the module docstring). Validation calls it for
    every line, so the common case (string contents, no tools) stays a few microseconds."""
    found = endpoint(request.url)
    if not found.prefix_grouped:
        return None
    body = request.body
    messages = found.messages(body)
    if not messages:
        return None
    context = "".join(map(_message_text, messages[:-1]))
    if len(context) >= PREFIX_MIN_CHARS:
        shared = context[:PREFIX_MAX_CHARS]
    else:
        whole = context + _message_text(messages[-1])
        if len(whole) <= PREFIX_BLOCK_CHARS:
            return None
        shared = whole[:PREFIX_BLOCK_CHARS]
    rendered = [(name, body[name]) for name in _RENDERED_FIELDS if name in body]
    head = request.model + (json.dumps(rendered, sort_keys=True, separators=(",", ":"))
                            if rendered else "")
    # Python's own string hash: 64 bits, ~5x faster than a cryptographic digest over the
    # ~1-16 kB hashed here (a quarter of validation's time on a million lines). It is
    # salted per process, so keys are compared only within the validation that made them;
    # a collision would only put two groups together.
    return PrefixKey(digest=hash(f"{head}\x1c{shared}") & 0xFFFF_FFFF_FFFF_FFFF,
                     chars=len(shared))
