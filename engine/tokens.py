"""Prompt sizes in the model's own tokens, counted as its engine counts them: the model's
tokenizer and chat template, loaded with transformers (no engine, no GPU).

Tokenizing every line of a large batch would cost more than validating it, so `over` first
takes a cheap upper bound and tokenizes only when the bound is over the limit. The bound:
a tokenizer never makes more tokens of a text than the text has UTF-8 bytes (byte-level
BPE, SentencePiece with byte fallback and WordPiece alike), plus what the chat template
adds around the messages (measured once per sequence of roles), plus a few tokens per
message for pieces that split differently where text and template meet.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from engine.base import ModelSpec
from engine.endpoints import endpoint, text_parts
from engine.endpoints.base import TOOL_TOKENS

# Tokens a message's text and the template around it can add by splitting differently
# where they meet than each does alone.
JOIN_SLACK = 4
# See `PromptCounter.bound`.
ALLOWANCE = 32


def _messages(messages: list[Any]) -> list[tuple[str, str]]:
    """(role, text) of each message of a prompt of the "chat" kind."""
    # Text parts joined with newlines, as vLLM does for text-only models.
    return [(m.get("role", "user"), "\n".join(text_parts(m.get("content"))))
            for m in messages]


class PromptCounter:
    """Prompt token counts of one model's requests (chat, messages, completions,
    embeddings, responses, score and rerank)."""

    def __init__(self, spec: ModelSpec) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(
            spec.options.get("tokenizer") or spec.path)
        self.chat_template = chat_template(spec.options.get("chat_template"))
        self._overheads: dict[tuple[str, ...], int] = {}
        # A fast tokenizer refuses to be used by two threads at once ("Already borrowed"):
        # a web process checks several files' budgets on its threads.
        self._lock = threading.Lock()

    def count(self, url: str, body: dict[str, Any]) -> int:
        """The prompt's tokens, exactly (for several prompts or inputs: the largest)."""
        found = endpoint(url)
        if found.kind == "chat":
            return len(self._chat_ids(_messages(found.messages(body))))
        return max((self._plain_count(p) for p in found.prompts(body)), default=0)

    def prompt_bound(self, url: str, body: dict[str, Any]) -> int | None:
        """An upper bound of the prompt tokens the engine counts for a request, media
        aside: a chat prompt rendered by the model's own template with its tools
        (`Endpoint.template_input`, as vLLM hands them over), plus JOIN_SLACK a message
        and TOOL_TOKENS a tool or tool call for what vLLM's request models add that this
        rendering does not (defaults such as a tool's `strict`, ids); the other kinds'
        prompts counted one by one, each with its special tokens. None where the template
        cannot render the prompt (the engine then refuses it too): the caller falls back
        to the bound without a tokenizer."""
        found = endpoint(url)
        with self._lock:
            if found.kind != "chat":
                return sum(self._plain_count(p) + JOIN_SLACK for p in found.prompts(body))
            shown = found.template_input(body)
            try:
                tokens = len(self._render(shown.messages, shown.tools or None))
            except Exception:  # a template's own raise_exception, a role order it refuses
                return None
        calls = sum(len(m.get("tool_calls") or ()) for m in shown.messages)
        return (tokens + JOIN_SLACK * len(shown.messages)
                + TOOL_TOKENS * (len(shown.tools) + calls))

    def bound(self, estimate: int, messages: int) -> int:
        """A loose upper bound of the count of a prompt of `messages` messages (0 for a plain
        prompt) whose text the cost preview estimated at `estimate` tokens: that estimate is
        a quarter of the text's characters, a character is at most 4 UTF-8 bytes, and the
        template adds what it adds to empty messages; that last part is doubled, plus
        ALLOWANCE, for role names and default system prompts that differ in length. For
        clearing whole chunks of ordinary lines without looking at each."""
        template = self._overhead(("user",) * messages)
        return 16 * estimate + 12 + 2 * template + JOIN_SLACK * max(messages, 1) + ALLOWANCE

    def over(self, url: str, body: dict[str, Any], limit: int) -> int | None:
        """The prompt's token count when it is over `limit`, else None."""
        found = endpoint(url)
        if found.kind == "chat":
            messages = _messages(found.messages(body))
            roles = tuple(role for role, _ in messages)
            bound = self._overhead(roles) + sum(len(text.encode()) + JOIN_SLACK
                                                for _, text in messages)
            if bound <= limit:
                return None
            tokens = len(self._chat_ids(messages))
        else:
            tokens = 0
            for prompt in found.prompts(body):
                if isinstance(prompt, str) and (len(prompt.encode()) + self._overhead(())
                                                + JOIN_SLACK) <= limit:
                    continue
                tokens = max(tokens, self._plain_count(prompt))
        return tokens if tokens > limit else None

    # --- helpers ---

    def _chat_ids(self, messages: list[tuple[str, str]]) -> list[int]:
        return self._render([{"role": role, "content": text} for role, text in messages])

    def _render(self, messages: list[dict[str, Any]],
                tools: list[Any] | None = None) -> list[int]:
        ids = self.tokenizer.apply_chat_template(
            messages, tools=tools, chat_template=self.chat_template,
            add_generation_prompt=True, tokenize=True)
        if not isinstance(ids, list):  # newer transformers return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def _overhead(self, roles: tuple[str, ...]) -> int:
        """Tokens the template (or, for plain prompts, the special tokens) add to empty
        texts."""
        if roles not in self._overheads:
            if roles:
                self._overheads[roles] = len(self._chat_ids([(role, "") for role in roles]))
            else:
                self._overheads[roles] = len(self.tokenizer("")["input_ids"])
        return self._overheads[roles]

    def _plain_count(self, prompt: Any) -> int:
        if isinstance(prompt, str):
            return len(self.tokenizer(prompt)["input_ids"])
        return len(prompt) if isinstance(prompt, list) else 0


def chat_template(option: Any) -> str | None:
    """A model's `chat_template` option as vLLM reads it: a file's path, or the template
    itself; None: the tokenizer's own."""
    if not isinstance(option, str) or not option:
        return None
    if "{" not in option and Path(option).is_file():
        return Path(option).read_text()
    return option
