"""The screener: the enabled content rules checked on the lines validation hands over a
chunk at a time (`jobs.policy.chunker`)."""

from __future__ import annotations

from operator import itemgetter
from typing import Any

from jobs.formats.wire import RequestLine
from jobs.models import ContentRule
from jobs.policy.embedding_rule import Moderation
from jobs.policy.re2rules import text_rules
from jobs.policy.size import PromptSizeRules
from jobs.policy.violation import Violation, ViolationSink

# Of a chunk's (line number, custom_id, tokens, text).
_TEXT = itemgetter(3)


class Screener:
    """The enabled rules, checked on lines that validation hands over a chunk at a time
    (`screen`), then `flush` at the end. `use_prefilter` False has RE2 read every chunk
    (tests check that path on its own)."""

    def __init__(self, rules: list[Any], *, use_prefilter: bool = True) -> None:
        self.rules = {rule.name: rule for rule in rules}
        self.text = text_rules(rules)
        self.prefilter = self.text.prefilter if use_prefilter else None
        self.size = PromptSizeRules(rules)
        self.moderation = Moderation(rules)

    @classmethod
    def load(cls) -> Screener | None:
        """The enabled rules, or None when there are none (validation then skips screening)."""
        rules = list(ContentRule.objects.filter(enabled=True).order_by("name"))
        return cls(rules) if rules else None

    def needs_requests(self, model: str) -> bool:
        """Whether `screen` needs each line's request, for a batch of `model` (validation
        lets one model through): when a prompt-size rule counts that model's own tokens.
        Else a line is only its number, custom_id, estimate and text, and validation lets
        go of the rest of it at once (holding the parsed requests costs more than the
        search: bench/RESULTS.md, section 8)."""
        return self.size.count_for(model)

    def screen(self, chunk: list[tuple[int, str, int, str]], sink: ViolationSink,
               requests: list[RequestLine] | None = None) -> None:
        """Screen a chunk of lines, each as (line number, custom_id, its prompt-size
        estimate, its `wire.prompt_text`), in one pass (see CHUNK_TOKENS for its size);
        `requests` are the lines' requests when `needs_requests` said so. Violations go to
        `sink`, a moderation rule's when its lines are embedded: call `flush` at the
        end."""
        if not chunk:
            return
        if self.size.counter is not None and (requests is None or
                                              len(requests) != len(chunk)):
            raise ValueError("a prompt-size rule counts tokens: pass the lines' requests")
        refused = (self.text.refused(list(map(_TEXT, chunk)), self.prefilter)
                   if self.text.rules else {})
        if self.moderation.rules:  # every line not refused yet waits for its embedding
            for i, line in enumerate(chunk):
                number, custom_id, _, text = line
                if i in refused:
                    sink(number, custom_id, Violation.of(refused[i]))
                elif not self.size.refuses(line, requests[i] if requests else None, sink):
                    self.moderation.add(number, custom_id, text)
            self.moderation.flush_full(sink)
            return
        # Else only the lines refused and those over a size limit are looked at, in order.
        oversized = self.size.maybe_oversized(chunk, requests) if self.size.rules else []
        for i in sorted({*refused, *oversized}) if oversized else sorted(refused):
            if i in refused:
                sink(chunk[i][0], chunk[i][1], Violation.of(refused[i]))
            else:
                self.size.refuses(chunk[i], requests[i] if requests else None, sink)

    def flush(self, sink: ViolationSink) -> None:
        """Embed the lines still waiting for a moderation rule."""
        self.moderation.flush(sink)
