"""What both searches of the term and regex rules read (RE2's, `jobs.policy.re2rules`, and
the Hyperscan prefilter's, `jobs.policy.prefilter`): a rule with its patterns (TextRule)
and a chunk of lines' text (ChunkText)."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate, count
from operator import add
from typing import Any

import re2

from jobs.lib.re2check import options


@dataclass
class TextRule:
    rule: Any
    scan: str  # its pattern in the sets; on ASCII text it decides as `exact` does
    exact: str  # the pattern that decides whether, and where, the rule matches
    loose: str  # its pattern in the prefilter: matches at least where `exact` does
    group: int  # the group of `exact` that is the match (terms consume edge characters)
    edges: bool  # uses the start or end of the text: not scanned in joined chunks
    compiled: Any = None
    compiled_scan: Any = None

    def search(self, data: bytes) -> int | None:
        """Where (in bytes) the rule's leftmost match in the UTF-8 text `data` starts, None
        if it does not match."""
        if data.isascii():  # `scan` decides there too, and its DFA is smaller (ASCII edges)
            if self.compiled_scan is None:
                self.compiled_scan = re2.compile(self.scan, options())
            match = self.compiled_scan.search(data)
        else:
            if self.compiled is None:
                self.compiled = re2.compile(self.exact, options())
            match = self.compiled.search(data)
        return None if match is None else match.start(self.group)


class ChunkText:
    """The text of a chunk of lines as RE2 reads it: the lines' texts joined with "\\n", in
    UTF-8."""

    def __init__(self, texts: list[str]) -> None:
        self.texts = texts
        text = "\n".join(texts)
        self.data = text.encode()
        self.ascii = len(self.data) == len(text)
        self._ends: list[int] | None = None

    def ends(self) -> list[int]:
        """Where each line's text ends in `data` (where the "\\n" after it is, or the end):
        computed only for a chunk where something matched, by C iterators."""
        if self._ends is None:
            lengths = (map(len, self.texts) if self.ascii else
                       map(len, map(str.encode, self.texts)))
            # The end of each text: its length and those of the texts and "\n"s before it.
            self._ends = list(map(add, accumulate(lengths), count()))
        return self._ends

    def text(self, i: int) -> bytes:
        """The text of line `i`, in UTF-8."""
        ends = self.ends()
        return self.data[ends[i - 1] + 1 if i else 0:ends[i]]
