"""Content policy: the operator's rules (ContentRule, edited in the admin) checked on every
input line while a batch validates.

Terms and regular expressions (RE2 syntax) are decided by RE2. A chunk of lines is searched
for all of them at once: by a Hyperscan prefilter naming the lines and rules to check, on
ASCII text, else by one RE2 pass ("terms and regular expressions" and "the fast path"
below; bench/policy.py measures it). The prompt-size rule counts the prompt
in the model's own tokens, with its tokenizer and chat template (`engine.tokens`: what the
engine reports as prompt_tokens), tokenizing only the lines a cheap bound cannot clear; for
a model without a tokenizer (the test engine) it uses the cost preview's estimate, 4
characters a token. A moderation rule embeds each prompt with a
configured embeddings model, through the same engine code as inference, and flags it when
it is close (cosine similarity) to one of the rule's example texts; lines are embedded in
chunks.
"""

from __future__ import annotations

import bisect
import logging
import math
import unicodedata
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import accumulate, count
from operator import add, attrgetter, itemgetter, methodcaller
from typing import Any

import re2

try:
    import hyperscan
except ImportError:  # no wheel for this platform: every chunk takes RE2's path
    hyperscan = None

from engine.base import EMBEDDINGS, Engine, EngineRequest
from engine.tokens import PromptCounter
from jobs.wire import RequestLine

VIOLATION = "content_policy_violation"
MODERATION_CHUNK = 256

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Violation:
    rule: str
    action: str  # "reject" or "skip"
    reason: str

    @property
    def message(self) -> str:
        return f"Refused by content rule '{self.rule}'" + (f": {self.reason}" if self.reason
                                                            else ".")


# (line number, custom_id, violation)
ViolationSink = Callable[[int, str, Violation], None]


_ENGINES: dict[str, Engine] = {}


def moderation_engine(model: str) -> Engine:
    """The embeddings engine for a moderation rule, loaded once per process."""
    if model not in _ENGINES:
        from engine import load_engine
        from jobs.engines import model_spec

        spec = model_spec(model)
        if spec is None or EMBEDDINGS not in spec.endpoints:
            raise ValueError(f"moderation model {model!r} is not a configured embeddings model")
        _ENGINES[model] = load_engine(spec)
    return _ENGINES[model]


def close_engines() -> None:
    """Shut down the moderation engines this process loaded (at worker stop: a vLLM engine
    left to the interpreter's exit can hang it)."""
    while _ENGINES:
        _, engine = _ENGINES.popitem()
        engine.close()


def embed(model: str, texts: list[str]) -> list[list[float]]:
    engine = moderation_engine(model)
    requests = [EngineRequest(request_id=f"moderation:{i}", url=EMBEDDINGS,
                              body={"model": model, "input": text[:2000]})
                for i, text in enumerate(texts)]
    vectors: dict[int, list[float]] = {}
    for result in engine.run(requests):
        index = int(result.request_id.split(":")[1])
        if result.status_code != 200:
            raise ValueError(f"moderation model failed: {result.body}")
        vectors[index] = result.body["data"][0]["embedding"]
    return [vectors[i] for i in range(len(texts))]


def _unit(vector: list[float]) -> list[float]:
    norm = math.sqrt(sum(x * x for x in vector)) or 1.0
    return [x / norm for x in vector]


# --- terms and regular expressions, with RE2 ---
#
# Lines are screened a chunk at a time (validation hands over a chunk of parsed lines): the
# texts of all their messages joined with "\n", one search (a DFA in C, linear in the text
# whatever the number of rules) of an alternation of all the term and regex rules. A clean
# chunk costs that one pass, and gathering its texts is done by C iterators, with no Python
# code run per line. Each match found names the line it starts in, which is then checked on
# its own with an RE2 set of the same rules (which of them match it, and, when several do,
# whose match is leftmost); the search goes on from the next line.
#
# A line's text is its messages joined with "\n", so the chunk's text is its lines' texts
# joined with "\n" too. That loses no match of a rule that cannot tell where a text starts
# or ends: a match inside a line's text is still there in the chunk (RE2 has no
# lookarounds, and "\n" is a non-word character, as the start and end of a text are for
# \b), and a match that spans two lines only costs a look at them. Rules that use ^, $, \A
# or \z are set apart and checked line by line.

# A word character, for whole-word terms: a letter, mark or digit in any script, or "_"
# (RE2's \b and \w are ASCII only). Terms are scanned with ASCII edges, which accept more
# (an é next to a term is not a word character to them) and compile a hundred times
# faster; a line they flag is then checked with the real edges.
_NOT_WORD = r"[^\p{L}\p{M}\p{N}_]"
_NOT_ASCII_WORD = "[^0-9A-Za-z_]"
# Validation hands lines over a chunk at a time: a chunk ends when its lines' prompt-size
# estimates, each line counting LINE_TOKENS more, reach CHUNK_TOKENS (one sum per line). So
# a chunk is at most CHUNK_TOKENS / LINE_TOKENS lines (enough that the calls into RE2 and
# the chunk's bookkeeping cost little per line, few enough that the lines are still in the
# CPU's caches when their texts are gathered: bench/policy.py) and holds about CHUNK_TOKENS
# tokens of text at most.
CHUNK_TOKENS = 65_536
LINE_TOKENS = 1_024
# Memory for each set (RE2's default, 8 MiB, is too small for a hundred rules).
_MAX_MEM = 64 << 20
# Of a chunk's (line number, custom_id, tokens, text), and of a chat body.
_TOKENS = itemgetter(2)
_TEXT = itemgetter(3)
_BODY = attrgetter("body")
_MESSAGES_OR_NONE = methodcaller("get", "messages", ())


def _options() -> re2.Options:
    options = re2.Options()
    options.case_sensitive = False
    options.log_errors = False
    options.max_mem = _MAX_MEM
    return options


def _error_text(exc: Exception) -> str:
    detail = exc.args[0] if exc.args else ""
    return detail.decode(errors="replace") if isinstance(detail, bytes) else str(detail)


def regex_problem(pattern: str) -> str | None:
    """Why `pattern` cannot be a regex rule (RE2 syntax), or None when it can."""
    try:
        re2.compile(pattern, _options())
        alone = re2.Set.SearchSet(_options())
        alone.Add(pattern)
        alone.Compile()
    except re2.error as exc:
        detail = _error_text(exc)
        if detail.startswith("failed to compile"):
            detail = "the expression is too large"
        return (f"Not a regular expression RE2 accepts ({detail}). RE2 has no "
                "backreferences (\\1, (?P=name)) and no lookarounds ((?=…), (?!…), (?<=…), "
                "(?<!…)); write \\z, not \\Z, for the end of the text.")
    return None


def _is_word_char(ch: str) -> bool:
    return ch == "_" or unicodedata.category(ch)[0] in "LMN"


def _term_pattern(term: str, not_word: str = _NOT_WORD) -> str:
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


@dataclass
class _TextRule:
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
                self.compiled_scan = re2.compile(self.scan, _options())
            match = self.compiled_scan.search(data)
        else:
            if self.compiled is None:
                self.compiled = re2.compile(self.exact, _options())
            match = self.compiled.search(data)
        return None if match is None else match.start(self.group)


def _compile_sets(patterns: list[tuple[int, str]]) -> list[tuple[Any, list[int]]]:
    """RE2 sets of (rule index, pattern), each with the rule index of each of its patterns:
    one set, or more if the rules together are too large for one."""
    if not patterns:
        return []
    matcher = re2.Set.SearchSet(_options())
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
    options = _options()
    options.never_capture = True  # only where matches start: RE2's DFAs find that
    try:
        return [re2.compile("|".join(f"(?:{p})" for p in patterns), options)]
    except re2.error:
        if len(patterns) == 1:  # (a \Q without \E cannot be put in a group)
            try:
                return [re2.compile(patterns[0], options)]
            except re2.error:
                logger.error("content rule pattern %r is too large for RE2; ignored",
                             patterns[0])
                return []
        half = len(patterns) // 2
        return _compile_scanners(patterns[:half]) + _compile_scanners(patterns[half:])


# --- the fast path: Hyperscan's prefilter on ASCII chunks ---
#
# RE2's DFA reads a byte at a time, about 1.8 ns a byte here whatever the rules (bench/
# policy.py): that alone was most of screening's cost. Hyperscan (Intel's SIMD regex
# library) finds where any of many patterns may match about twice as fast, and reports
# every match's end with its pattern. It decides nothing here: it only names, for each line
# of a chunk, the rules that may match it, and RE2 then searches that line for those rules
# alone. So it must never miss a match RE2 would find, and it is used only where its
# patterns are known to accept at least what RE2's do:
# - on chunks that are ASCII only, read as bytes, case-insensitive, in prefilter mode (it
#   may report more). There, an ASCII pattern means the same to both: their differences
#   are in Unicode (tables of different Unicode versions, and reading UTF-8 made Hyperscan
#   ten times slower), so RE2 reads every other chunk;
# - on chunks without a vertical tab, the one ASCII character the two disagree on (it is
#   \s to Hyperscan, \S to RE2);
# - when every rule is ASCII, or is a term that cannot match ASCII text (none of its
#   characters folds to an ASCII one: it is left out), and compiles (patterns that can
#   match an empty text do not): else RE2 reads every chunk.
# Its patterns are looser than the rules, which only adds lines to check: a term without
# its word edges, a regex with each \b and \B made an empty group (Hyperscan runs a third
# faster without them).
# tests/test_policy.py checks both paths against each rule searched alone.
_PREFILTER_FLAGS = (0 if hyperscan is None else
                    hyperscan.HS_FLAG_CASELESS | hyperscan.HS_FLAG_PREFILTER)
# Matches reported in a chunk before the prefilter gives the chunk up to RE2 (a rule such
# as "\d+" on a table of numbers would otherwise call back for every digit).
_PREFILTER_MAX_HITS = 256
# Off in tests that check RE2's own path.
USE_PREFILTER = True
_ASCII = "".join(map(chr, range(128)))


def _matches_ascii(term: str) -> bool:
    """Whether a term could match ASCII text: every character of it matches an ASCII one,
    case-insensitively as RE2 folds (K, the Kelvin sign, is k)."""
    return all(ch.isascii() or re2.search(re2.escape(ch), _ASCII, _options()) is not None
               for ch in term)


class _Prefilter:
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
    def build(cls, rules: list[_TextRule]) -> _Prefilter | None:
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

    def candidates(self, chunk: _ChunkText) -> dict[int, set[int]] | None:
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


class _TextRules:
    """The term and regex rules of a rule list, compiled."""

    def __init__(self, rules: list[Any]) -> None:
        # In rule (name) order: a line is refused by the leftmost match of any of them, the
        # first such rule when several match at the same place.
        self.rules: list[_TextRule] = []
        for rule in rules:
            if rule.kind == "term" and rule.pattern.strip():
                term = rule.pattern.strip()
                self.rules.append(_TextRule(rule, _term_pattern(term, _NOT_ASCII_WORD),
                                            _term_pattern(term), re2.escape(term), 1, False))
            elif rule.kind == "regex" and rule.pattern:
                try:
                    re2.compile(rule.pattern, _options())
                except re2.error as exc:  # saved without the admin's check
                    logger.error("content rule %r ignored: %s", rule.name, _error_text(exc))
                    continue
                self.rules.append(_TextRule(rule, rule.pattern, rule.pattern,
                                            _without_word_boundaries(rule.pattern), 0,
                                            _uses_text_edges(rule.pattern)))
        self.chunk_sets = _compile_sets([(i, t.scan) for i, t in enumerate(self.rules)
                                         if not t.edges])
        self.scanners = _compile_scanners([t.scan for t in self.rules if not t.edges])
        self.line_sets = _compile_sets([(i, t.scan) for i, t in enumerate(self.rules)
                                        if t.edges])
        self.prefilter = _Prefilter.build(self.rules)


# The last rule list compiled, kept while the rules do not change: a worker validating
# batch after batch compiles them once (and RE2's DFA stays built).
_COMPILED: dict[tuple[Any, ...], _TextRules] = {}


def _text_rules(rules: list[Any]) -> _TextRules:
    key = tuple((r.name, r.kind, r.pattern, r.action, r.reason) for r in rules
                if r.kind in ("term", "regex"))
    compiled = _COMPILED.get(key)
    if compiled is None:
        compiled = _TextRules(rules)
        _COMPILED.clear()
        _COMPILED[key] = compiled
    return compiled


class _ChunkText:
    """The text of a chunk of lines as RE2 reads it: the lines' texts joined with "\n", in
    UTF-8."""

    def __init__(self, texts: list[str]) -> None:
        self.texts = texts
        text = "\n".join(texts)
        self.data = text.encode()
        self.ascii = len(self.data) == len(text)
        self._ends: list[int] | None = None

    def ends(self) -> list[int]:
        """Where each line's text ends in `data` (where the "\n" after it is, or the end):
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


class Screener:
    """The enabled rules, checked on lines that validation hands over a chunk at a time
    (`screen`), then `flush` at the end."""

    def __init__(self, rules: list[Any]) -> None:
        self.rules = {rule.name: rule for rule in rules}
        compiled = _text_rules(rules)
        self.text_rules = compiled.rules
        self.chunk_sets = compiled.chunk_sets
        self.line_sets = compiled.line_sets
        self.scanners = compiled.scanners
        self.prefilter = compiled.prefilter if USE_PREFILTER else None
        self.size_rules = [r for r in rules if r.kind == "max_prompt_tokens" and r.max_tokens]
        self.size_floor = min((r.max_tokens for r in self.size_rules), default=0)
        self.counters: dict[str, PromptCounter | None] = {}
        self.counter: PromptCounter | None = None  # the batch model's (`needs_requests`)
        self.moderation = [r for r in rules if r.kind == "moderation" and r.model]
        self.examples: dict[str, list[list[float]]] = {}
        self.pending: list[tuple[int, str, str]] = []  # (line, custom_id, text)

    @classmethod
    def load(cls) -> Screener | None:
        """The enabled rules, or None when there are none (validation then skips screening)."""
        from jobs.models import ContentRule

        rules = list(ContentRule.objects.filter(enabled=True).order_by("name"))
        return cls(rules) if rules else None

    def violation(self, rule: Any) -> Violation:
        return Violation(rule=rule.name, action=rule.action, reason=rule.reason)

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
            only = self.text_rules[indexes[0]]
            if only.scan == only.exact or data.isascii():
                return only.rule
        return self._leftmost(data, indexes)

    def _leftmost(self, data: bytes, indexes: list[int]) -> Any | None:
        """Of the text rules at `indexes`, the one whose match in `data` is leftmost (the
        first by name on a tie); None when none matches."""
        found: Any | None = None
        first = -1
        for i in sorted(set(indexes)):
            start = self.text_rules[i].search(data)
            if start is not None and (found is None or start < first):
                found, first = self.text_rules[i].rule, start
        return found

    def needs_requests(self, model: str) -> bool:
        """Whether `screen` needs each line's request, for a batch of `model` (validation
        lets one model through): when a prompt-size rule counts that model's own tokens.
        Else a line is only its number, custom_id, estimate and text, and validation lets
        go of the rest of it at once (holding every parsed request of a chunk cost more
        than the search itself: bench/policy.py)."""
        self.counter = self._counter(model) if self.size_rules else None
        return self.counter is not None

    def screen(self, chunk: list[tuple[int, str, int, str]], sink: ViolationSink,
               requests: list[RequestLine] | None = None) -> None:
        """Screen a chunk of lines, each as (line number, custom_id, its prompt-size
        estimate, its `wire.prompt_text`), in one pass (see CHUNK_TOKENS for its size);
        `requests` are the lines' requests when `needs_requests` said so. Violations go to
        `sink`, a moderation rule's when its lines are embedded: call `flush` at the
        end."""
        if not chunk:
            return
        if self.counter is not None and (requests is None or len(requests) != len(chunk)):
            raise ValueError("a prompt-size rule counts tokens: pass the lines' requests")
        refused = self._text_refused(list(map(_TEXT, chunk))) if self.text_rules else {}
        if self.moderation:  # every line not refused yet waits for its embedding
            for i, line in enumerate(chunk):
                number, custom_id, _, text = line
                if i in refused:
                    sink(number, custom_id, self.violation(refused[i]))
                elif not self._check_size(line, requests[i] if requests else None, sink):
                    self.pending.append((number, custom_id, text))
            if len(self.pending) >= MODERATION_CHUNK:
                self._moderate(sink)
            return
        # Else only the lines refused and those over a size limit are looked at, in order.
        oversized = self._maybe_oversized(chunk, requests) if self.size_rules else []
        for i in sorted({*refused, *oversized}) if oversized else sorted(refused):
            if i in refused:
                sink(chunk[i][0], chunk[i][1], self.violation(refused[i]))
            else:
                self._check_size(chunk[i], requests[i] if requests else None, sink)

    def _text_refused(self, texts: list[str]) -> dict[int, Any]:
        """Position in `texts` (lines' prompt texts) -> the term or regex rule refusing
        that line."""
        chunk = _ChunkText(texts)
        every_line = range(len(texts)) if self.line_sets else None
        refused: dict[int, Any] = {}
        candidates = self.prefilter.candidates(chunk) if self.prefilter else None
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

    def _check_size(self, line: tuple[int, str, int, str], request: RequestLine | None,
                    sink: ViolationSink) -> bool:
        """Whether a prompt-size rule refuses the line (then told to `sink`)."""
        if not self.size_rules:
            return False
        number, custom_id, estimate, _ = line
        tokens = (self.counter.over(request.url, request.body, self.size_floor)
                  if self.counter is not None and request is not None else
                  estimate if estimate > self.size_floor else None)
        if tokens is None:
            return False
        for rule in self.size_rules:
            if tokens > rule.max_tokens:
                sink(number, custom_id, self.violation(rule))
                return True
        return False

    def _maybe_oversized(self, chunk: list[tuple[int, str, int, str]],
                         requests: list[RequestLine] | None) -> list[int]:
        """The lines of a chunk a prompt-size rule must look at: over the smallest limit
        by the estimate, or, for models counted exactly, by a loose bound from the
        estimate (`PromptCounter.bound`); the whole chunk clears at once when its largest
        line does."""
        floor = self.size_floor
        largest = max(map(_TOKENS, chunk))
        if self.counter is None or not requests:
            if largest <= floor:
                return []
            return [i for i, (_, _, tokens, _) in enumerate(chunk) if tokens > floor]
        messages = max(map(len, map(_MESSAGES_OR_NONE, map(_BODY, requests))))
        if self.counter.bound(largest, messages) <= floor:
            return []
        return list(range(len(chunk)))  # each line bounded again, or counted (over)

    def _counter(self, model: Any) -> PromptCounter | None:
        """The model's prompt token counter, loaded once; None for a model without a
        tokenizer (or not served here: validation refuses its lines anyway)."""
        if not isinstance(model, str):
            return None
        if model not in self.counters:
            from jobs.engines import model_spec

            spec = model_spec(model)
            self.counters[model] = (PromptCounter(spec) if spec is not None and
                                    spec.backend == "vllm" and spec.path else None)
        return self.counters[model]

    def _suspects(self, chunk: _ChunkText) -> set[int]:
        """The lines of a chunk where a term or regex may match. A scanner's leftmost match
        names the line it starts in, and the next line too when it starts at the "\n"
        between them (a term's edge may be that character); the search goes on from the
        "\n" after the line named."""
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

    def flush(self, sink: ViolationSink) -> None:
        """Embed the lines still waiting for a moderation rule."""
        self._moderate(sink)

    def _moderate(self, sink: ViolationSink) -> None:
        if not self.pending:
            return
        chunk, self.pending = self.pending, []
        flagged: set[int] = set()
        for rule in self.moderation:
            if rule.name not in self.examples:
                examples = [t for t in rule.pattern.splitlines() if t.strip()]
                self.examples[rule.name] = [_unit(v) for v in embed(rule.model, examples)]
            vectors = [_unit(v) for v in embed(rule.model, [text for _, _, text in chunk])]
            for (number, custom_id, _), vector in zip(chunk, vectors, strict=True):
                if number in flagged:
                    continue
                score = max((sum(a * b for a, b in zip(vector, example, strict=True))
                             for example in self.examples[rule.name]), default=0.0)
                if score >= (rule.threshold if rule.threshold is not None else 0.8):
                    flagged.add(number)
                    sink(number, custom_id, self.violation(rule))
