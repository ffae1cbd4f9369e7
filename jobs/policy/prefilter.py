"""The fast path: Hyperscan's prefilter on ASCII chunks.

RE2's DFA reads a byte at a time, and that pass was most of screening's cost; Hyperscan
(Intel's SIMD regex library) finds where any of many patterns may match faster
(bench/RESULTS.md, section 8), and reports every match's end with its pattern. It decides
nothing here: it only names, for each line of a chunk, the rules that may match it, and RE2
then searches that line for those rules alone. So it must never miss a match RE2 would
find, and it is used only where its patterns are known to accept at least what RE2's do:
- on chunks that are ASCII only, read as bytes, case-insensitive, in prefilter mode (it
  may report more). There, an ASCII pattern means the same to both: their differences
  are in Unicode (tables of different Unicode versions, and Hyperscan reads UTF-8 far
  slower), so RE2 reads every other chunk;
- on chunks without a vertical tab, the one ASCII character the two disagree on (it is
  \\s to Hyperscan, \\S to RE2);
- when every rule is ASCII, or is a term that cannot match ASCII text (none of its
  characters folds to an ASCII one: it is left out), and compiles (patterns that can
  match an empty text do not): else RE2 reads every chunk.
Its patterns are looser than the rules, which only adds lines to check: a term without
its word edges, a regex with each \\b and \\B made an empty group (Hyperscan is faster
without them).
tests/services/test_policy.py checks both paths against each rule searched alone.
"""

from __future__ import annotations

import bisect
import logging
from typing import Any

import re2

from jobs.lib.re2check import options
from jobs.policy.texts import ChunkText, TextRule

hyperscan: Any
try:
    import hyperscan
except ImportError:  # no wheel for this platform: every chunk takes RE2's path
    hyperscan = None

logger = logging.getLogger(__name__)

_PREFILTER_FLAGS = (0 if hyperscan is None else
                    hyperscan.HS_FLAG_CASELESS | hyperscan.HS_FLAG_PREFILTER)
# Matches reported in a chunk before the prefilter gives the chunk up to RE2 (a rule such
# as "\d+" on a table of numbers would otherwise call back for every digit).
_PREFILTER_MAX_HITS = 256
_ASCII = "".join(map(chr, range(128)))


def _matches_ascii(term: str) -> bool:
    """Whether a term could match ASCII text: every character of it matches an ASCII one,
    case-insensitively as RE2 folds (K, the Kelvin sign, is k)."""
    return all(ch.isascii() or re2.search(re2.escape(ch), _ASCII, options()) is not None
               for ch in term)


class Prefilter:
    """A Hyperscan database of the chunk-scanned rules: which rules may match which lines
    of an ASCII chunk (`candidates`)."""

    def __init__(self, patterns: list[tuple[int, str]]) -> None:
        # None when no rule can match ASCII text (non-ASCII terms only): nothing to scan.
        self.database = hyperscan.Database() if patterns else None
        if self.database is not None:
            self.database.compile(expressions=[p.encode() for _, p in patterns],
                                  ids=[index for index, _ in patterns], elements=len(patterns),
                                  flags=[_PREFILTER_FLAGS] * len(patterns))

    @classmethod
    def build(cls, rules: list[TextRule]) -> Prefilter | None:
        """The prefilter of the rules scanned a chunk at a time; None when one of them
        cannot be in it."""
        if hyperscan is None:
            return None
        patterns: list[tuple[int, str]] = []
        for index, rule in enumerate(rules):
            if rule.edges:
                continue
            if rule.loose.isascii():
                patterns.append((index, rule.loose))
            elif rule.rule.kind != "term" or _matches_ascii(rule.rule.pattern.strip()):
                return None
        try:
            return cls(patterns)
        except hyperscan.error as exc:
            logger.info("content rules screened by RE2 alone: %s", exc)
            return None

    def candidates(self, chunk: ChunkText) -> dict[int, set[int]] | None:
        """Line position in the chunk -> the rules that may match that line; None when the
        chunk is not one this prefilter may read, or when it matches too often."""
        if not chunk.ascii or b"\v" in chunk.data:
            return None
        if self.database is None:
            return {}
        hits: list[tuple[int, int]] = []

        def on_match(rule: int, start: int, end: int, flags: int, context: Any) -> bool:
            hits.append((rule, end))
            return len(hits) > _PREFILTER_MAX_HITS  # True stops the scan

        try:
            self.database.scan(chunk.data, match_event_handler=on_match)
        except hyperscan.error:  # stopped (too many matches), or scratch space in use
            return None
        found: dict[int, set[int]] = {}
        if hits:
            ends = chunk.ends()
            for rule, end in hits:
                # A match ending at `end` covers the byte before it, which is in the line
                # named (a "\n" after a line counts as that line's). No match is empty: a
                # pattern that could match an empty text does not compile.
                line = bisect.bisect_left(ends, end - 1)
                found.setdefault(line, set()).add(rule)
        return found
