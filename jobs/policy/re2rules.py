"""The term and regex rules, decided by RE2.

Lines are screened a chunk at a time (validation hands over a chunk of parsed lines): the
texts of all their messages joined with "\\n", one search (a DFA in C, linear in the text
whatever the number of rules) of an alternation of all the term and regex rules. A clean
chunk costs that one pass, and gathering its texts is done by C iterators, with no Python
code run per line. Each match found names the line it starts in, which is then checked on
its own with an RE2 set of the same rules (which of them match it, and, when several do,
whose match is leftmost); the search goes on from the next line. On ASCII chunks, a
Hyperscan prefilter may name the lines and rules to check instead (`jobs.policy.prefilter`).
What both read, a compiled rule and a chunk's text, is `jobs.policy.texts`.

A line's text is its messages joined with "\\n", so the chunk's text is its lines' texts
joined with "\\n" too. That loses no match of a rule that cannot tell where a text starts
or ends: a match inside a line's text is still there in the chunk (RE2 has no
lookarounds, and "\\n" is a non-word character, as the start and end of a text are for
\\b), and a match that spans two lines only costs a look at them. Rules that use ^, $, \\A
or \\z are set apart and checked line by line.
"""

from __future__ import annotations

import bisect
import logging
import unicodedata
from collections.abc import Iterator
from typing import Any

import re2

from jobs.lib.re2check import error_text, options
from jobs.policy.prefilter import Prefilter
from jobs.policy.texts import ChunkText, TextRule

logger = logging.getLogger(__name__)

# A word character, for whole-word terms: a letter, mark or digit in any script, or "_"
# (RE2's \b and \w are ASCII only). Terms are scanned with ASCII edges, which accept more
# (an é next to a term is not a word character to them) but compile far faster
# (bench/RESULTS.md, section 8); a line they flag is then checked with the real edges.
_NOT_WORD = r"[^\p{L}\p{M}\p{N}_]"
_NOT_ASCII_WORD = "[^0-9A-Za-z_]"


def _is_word_char(ch: str) -> bool:
    return ch == "_" or unicodedata.category(ch)[0] in "LMN"


def term_pattern(term: str, not_word: str = _NOT_WORD) -> str:
    """`term` as a whole word: not glued to a word character at an end where the term
    itself has one. The term is group 1 (the edges consume a character)."""
    return ((f"(?:^|{not_word})" if _is_word_char(term[0]) else "") +
            f"({re2.escape(term)})" +
            (f"(?:$|{not_word})" if _is_word_char(term[-1]) else ""))


def _tokens_outside_classes(pattern: str) -> Iterator[tuple[int, int]]:
    """The (start, end) of each token of an RE2 pattern outside character classes and
    \\Q…\\E quotes: an escape (a backslash and the character after it) or one character."""
    i, n = 0, len(pattern)
    in_class = False
    while i < n:
        ch = pattern[i]
        if ch == "\\":
            if pattern[i + 1:i + 2] == "Q":
                end = pattern.find("\\E", i + 2)
                i = n if end < 0 else end + 2
                continue
            if not in_class:
                yield i, i + 2
            i += 2
            continue
        if in_class:
            if ch == "[" and pattern.startswith("[:", i):
                end = pattern.find(":]", i + 2)
                i = n if end < 0 else end + 2
                continue
            if ch == "]":
                in_class = False
        elif ch == "[":
            in_class = True
            i += 1
            if pattern.startswith("^", i):
                i += 1
            if pattern.startswith("]", i):  # a leading ] is a literal
                i += 1
            continue
        else:
            yield i, i + 1
        i += 1


def _uses_text_edges(pattern: str) -> bool:
    """Whether an RE2 pattern may use ^, $, \\A or \\z (an over-approximation: any of them
    outside a character class or a \\Q…\\E quote)."""
    return any(pattern[start:end] in ("^", "$", "\\A", "\\z")
               for start, end in _tokens_outside_classes(pattern))


def _without_word_boundaries(pattern: str) -> str:
    """`pattern` with each \\b and \\B made an empty group: it matches wherever the pattern
    does, and more (a prefilter's pattern)."""
    pieces: list[str] = []
    last = 0
    for start, end in _tokens_outside_classes(pattern):
        if pattern[start:end] in ("\\b", "\\B"):
            pieces += [pattern[last:start], "(?:)"]
            last = end
    return "".join(pieces) + pattern[last:]


def _compile_sets(patterns: list[tuple[int, str]]) -> list[tuple[Any, list[int]]]:
    """RE2 sets of (rule index, pattern), each with the rule index of each of its patterns:
    one set, or more if the rules together are too large for one."""
    if not patterns:
        return []
    matcher = re2.Set.SearchSet(options())
    try:
        for _, pattern in patterns:
            matcher.Add(pattern)
        matcher.Compile()
    except re2.error:
        if len(patterns) == 1:
            logger.error("content rule pattern %r is too large for RE2; ignored",
                         patterns[0][1])
            return []
        half = len(patterns) // 2
        return _compile_sets(patterns[:half]) + _compile_sets(patterns[half:])
    return [(matcher, [index for index, _ in patterns])]


def _matching(sets: list[tuple[Any, list[int]]], data: bytes) -> list[int]:
    """The rule indexes of the patterns in `sets` that match `data` (UTF-8)."""
    found: list[int] = []
    for matcher, indexes in sets:
        found.extend([indexes[i] for i in matcher.Match(data) or ()])
    return found


def _compile_scanners(patterns: list[str]) -> list[Any]:
    """RE2 regexes that together match where any of `patterns` does: one alternation of
    them all, or more if they do not compile as one."""
    if not patterns:
        return []
    scanner_options = options()
    scanner_options.never_capture = True  # only where matches start: RE2's DFAs find that
    try:
        return [re2.compile("|".join(f"(?:{p})" for p in patterns), scanner_options)]
    except re2.error:
        if len(patterns) == 1:  # (a \Q without \E cannot be put in a group)
            try:
                return [re2.compile(patterns[0], scanner_options)]
            except re2.error:
                logger.error("content rule pattern %r is too large for RE2; ignored",
                             patterns[0])
                return []
        half = len(patterns) // 2
        return _compile_scanners(patterns[:half]) + _compile_scanners(patterns[half:])


class TextRules:
    """The term and regex rules of a rule list, compiled (`text_rules` keeps the last
    list's), and which of them refuses a line."""

    def __init__(self, rules: list[Any]) -> None:
        # In rule (name) order: a line is refused by the leftmost match of any of them, the
        # first such rule when several match at the same place.
        self.rules: list[TextRule] = []
        for rule in rules:
            if rule.kind == "term" and rule.pattern.strip():
                term = rule.pattern.strip()
                self.rules.append(TextRule(rule, term_pattern(term, _NOT_ASCII_WORD),
                                           term_pattern(term), re2.escape(term), 1, False))
            elif rule.kind == "regex" and rule.pattern:
                try:
                    re2.compile(rule.pattern, options())
                except re2.error as exc:  # saved without the admin's check
                    logger.error("content rule %r ignored: %s", rule.name, error_text(exc))
                    continue
                self.rules.append(TextRule(rule, rule.pattern, rule.pattern,
                                           _without_word_boundaries(rule.pattern), 0,
                                           _uses_text_edges(rule.pattern)))
        self.chunk_sets = _compile_sets([(i, t.scan) for i, t in enumerate(self.rules)
                                         if not t.edges])
        self.scanners = _compile_scanners([t.scan for t in self.rules if not t.edges])
        self.line_sets = _compile_sets([(i, t.scan) for i, t in enumerate(self.rules)
                                        if t.edges])
        self.prefilter = Prefilter.build(self.rules)

    def text_match(self, text: str | bytes) -> Any | None:
        """The term or regex rule refusing `text` (or its UTF-8 bytes): the leftmost match,
        the first rule when several match at the same place. None when none matches."""
        data = text.encode() if isinstance(text, str) else text
        return self._refusing(data, _matching(self.chunk_sets, data) +
                              _matching(self.line_sets, data))

    def _refusing(self, data: bytes, indexes: list[int]) -> Any | None:
        """Of the text rules at `indexes` (those that match the UTF-8 text `data`), the one
        whose match is leftmost."""
        # One rule matching decides, unless it is a term scanned with ASCII edges and the
        # text is not ASCII (on ASCII text those edges are the real ones).
        if len(set(indexes)) == 1:
            only = self.rules[indexes[0]]
            if only.scan == only.exact or data.isascii():
                return only.rule
        return self._leftmost(data, indexes)

    def _leftmost(self, data: bytes, indexes: list[int]) -> Any | None:
        """Of the text rules at `indexes`, the one whose match in `data` is leftmost (the
        first by name on a tie); None when none matches."""
        found: Any | None = None
        first = -1
        for i in sorted(set(indexes)):
            start = self.rules[i].search(data)
            if start is not None and (found is None or start < first):
                found, first = self.rules[i].rule, start
        return found

    def refused(self, texts: list[str], prefilter: Prefilter | None) -> dict[int, Any]:
        """Position in `texts` (lines' prompt texts) -> the term or regex rule refusing
        that line; with a `prefilter`, on the chunks it may read."""
        chunk = ChunkText(texts)
        every_line = range(len(texts)) if self.line_sets else None
        refused: dict[int, Any] = {}
        candidates = prefilter.candidates(chunk) if prefilter else None
        if candidates is not None:
            # The lines Hyperscan names, each searched by RE2 for the rules named; every
            # line, when a rule uses the text's edges.
            for i in every_line or sorted(candidates):
                text = chunk.text(i)
                rule = self._leftmost(text, [*candidates.get(i, ()),
                                             *_matching(self.line_sets, text)])
                if rule is not None:
                    refused[i] = rule
            return refused
        # One RE2 search of the whole chunk: the lines where a term or regex may match,
        # each then checked on its own; every line, when a rule uses the text's edges.
        suspects = self._suspects(chunk)
        for i in every_line or suspects:
            text = chunk.text(i)
            rule = (self.text_match(text) if i in suspects else
                    self._refusing(text, _matching(self.line_sets, text)))
            if rule is not None:
                refused[i] = rule
        return refused

    def _suspects(self, chunk: ChunkText) -> set[int]:
        """The lines of a chunk where a term or regex may match. A scanner's leftmost match
        names the line it starts in, and the next line too when it starts at the "\\n"
        between them (a term's edge may be that character); the search goes on from the
        "\\n" after the line named."""
        suspects: set[int] = set()
        for scanner in self.scanners:
            line = position = 0
            while (match := scanner.search(chunk.data, position)) is not None:
                ends = chunk.ends()
                line = max(line, bisect.bisect_left(ends, match.start()))
                if line == len(ends):
                    break
                suspects.add(line)
                position = ends[line]
                line += 1
        return suspects


# The last rule list compiled, kept while the rules do not change: a worker validating
# batch after batch compiles them once (and RE2's DFA stays built).
_COMPILED: dict[tuple[Any, ...], TextRules] = {}


def text_rules(rules: list[Any]) -> TextRules:
    """The term and regex rules of `rules`, compiled once while they do not change."""
    key = tuple((r.name, r.kind, r.pattern, r.action, r.reason) for r in rules
                if r.kind in ("term", "regex"))
    compiled = _COMPILED.get(key)
    if compiled is None:
        compiled = TextRules(rules)
        _COMPILED.clear()
        _COMPILED[key] = compiled
    return compiled
