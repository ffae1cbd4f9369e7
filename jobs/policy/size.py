"""The prompt-size rule: the prompt counted in the model's own tokens, with its tokenizer and
chat template (`engine.tokens`: what the engine reports as prompt_tokens), tokenizing only
the lines a cheap bound cannot clear. For a model without a tokenizer (the test engine) it
uses the cost preview's estimate, 4 characters a token."""

from __future__ import annotations

from operator import itemgetter
from typing import Any

from engine.endpoints import request_messages
from engine.tokens import PromptCounter
from jobs.formats.wire import RequestLine
from jobs.policy.violation import Violation, ViolationSink

# Of a chunk's (line number, custom_id, tokens, text).
_TOKENS = itemgetter(2)


class PromptSizeRules:
    """The prompt-size rules of a rule list (`rules`, empty when there are none)."""

    def __init__(self, rules: list[Any]) -> None:
        self.rules = [r for r in rules if r.kind == "max_prompt_tokens" and r.max_tokens]
        self.floor = min((r.max_tokens for r in self.rules), default=0)
        self.counter: PromptCounter | None = None  # the batch model's (`count_for`)

    def count_for(self, model: Any) -> bool:
        """Count the prompts of a batch of `model` in its own tokens; whether that needs
        each line's request (a model with a tokenizer)."""
        self.counter = self._counter(model) if self.rules else None
        return self.counter is not None

    def refuses(self, line: tuple[int, str, int, str], request: RequestLine | None,
                sink: ViolationSink) -> bool:
        """Whether a prompt-size rule refuses the line (then told to `sink`)."""
        if not self.rules:
            return False
        number, custom_id, estimate, _ = line
        tokens = (self.counter.over(request.url, request.body, self.floor)
                  if self.counter is not None and request is not None else
                  estimate if estimate > self.floor else None)
        if tokens is None:
            return False
        for rule in self.rules:
            if tokens > rule.max_tokens:
                sink(number, custom_id, Violation.of(rule))
                return True
        return False

    def maybe_oversized(self, chunk: list[tuple[int, str, int, str]],
                        requests: list[RequestLine] | None) -> list[int]:
        """The lines of a chunk a prompt-size rule must look at: over the smallest limit
        by the estimate, or, for models counted exactly, by a loose bound from the
        estimate (`PromptCounter.bound`); the whole chunk clears at once when its largest
        line does."""
        floor = self.floor
        largest = max(map(_TOKENS, chunk))
        if self.counter is None or not requests:
            if largest <= floor:
                return []
            return [i for i, (_, _, tokens, _) in enumerate(chunk) if tokens > floor]
        messages = max(len(request_messages(r.url, r.body)) for r in requests)
        if self.counter.bound(largest, messages) <= floor:
            return []
        return list(range(len(chunk)))  # each line bounded again, or counted (over)

    def _counter(self, model: Any) -> PromptCounter | None:
        """The model's prompt token counter (`jobs.formats.prompts.counter_for`, loaded once a
        process); None for a model without a tokenizer (or not served here: validation
        refuses its lines anyway)."""
        if not isinstance(model, str):
            return None
        from jobs.formats.prompts import counter_for
        from jobs.lib.model_registry import model_spec

        return counter_for(model_spec(model))
