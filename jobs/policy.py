"""Content policy: the operator's rules (ContentRule, edited in the admin) checked on every
input line while a batch validates.

Terms and regular expressions (RE2 syntax) are compiled with RE2 and searched all at once,
in one pass in C over a chunk of lines whatever their number (see "terms and regular
expressions" below; bench/policy.py measures it). The prompt-size rule counts the prompt
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
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate, chain, count
from operator import add, attrgetter, itemgetter, methodcaller
from typing import Any

import re2

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


def prompt_text(line: RequestLine) -> str:
    """All the text a request sends to the model, joined."""
    body = line.body
    if "messages" in body:
        try:  # the common case, every content a string
            return "\n".join([m["content"] for m in body["messages"]])
        except (KeyError, TypeError):
            pass
        values: list[Any] = [m.get("content") for m in body["messages"]]
    else:
        values = [body.get("prompt", body.get("input"))]
    parts: list[str] = []
    for value in values:
        if isinstance(value, str):
            parts.append(value)
        elif isinstance(value, list):
            parts.extend(v if isinstance(v, str) else str(v.get("text", ""))
                         for v in value if isinstance(v, str | dict))
    return "\n".join(parts)


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
# Of a chunk's (line number, line, tokens), and of a chat body and its messages.
_LINE = itemgetter(1)
_TOKENS = itemgetter(2)
_BODY = attrgetter("body")
_MESSAGES = itemgetter("messages")
_MESSAGES_OR_NONE = methodcaller("get", "messages", ())
_CONTENT = itemgetter("content")


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


def _uses_text_edges(pattern: str) -> bool:
    """Whether an RE2 pattern may use ^, $, \\A or \\z (an over-approximation: any of them
    outside a character class or a \\Q…\\E quote)."""
    i, n = 0, len(pattern)
    in_class = False
    while i < n:
        ch = pattern[i]
        if ch == "\\":
            following = pattern[i + 1:i + 2]
            if following == "Q":
                end = pattern.find("\\E", i + 2)
                i = n if end < 0 else end + 2
                continue
            if not in_class and following in ("A", "z"):
                return True
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
        elif ch in "^$":
            return True
        i += 1
    return False


@dataclass
class _TextRule:
    rule: Any
    scan: str  # its pattern in the sets
    exact: str  # the pattern that decides whether, and where, the rule matches
    group: int  # the group of `exact` that is the match (terms consume edge characters)
    edges: bool  # uses the start or end of the text: not scanned in joined chunks
    compiled: Any = None

    def search(self, data: bytes) -> int | None:
        """Where (in bytes) the rule's leftmost match in the UTF-8 text `data` starts, None
        if it does not match."""
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
                                            _term_pattern(term), 1, False))
            elif rule.kind == "regex" and rule.pattern:
                try:
                    re2.compile(rule.pattern, _options())
                except re2.error as exc:  # saved without the admin's check
                    logger.error("content rule %r ignored: %s", rule.name, _error_text(exc))
                    continue
                self.rules.append(_TextRule(rule, rule.pattern, rule.pattern, 0,
                                            _uses_text_edges(rule.pattern)))
        self.chunk_sets = _compile_sets([(i, t.scan) for i, t in enumerate(self.rules)
                                         if not t.edges])
        self.scanners = _compile_scanners([t.scan for t in self.rules if not t.edges])
        self.line_sets = _compile_sets([(i, t.scan) for i, t in enumerate(self.rules)
                                        if t.edges])


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

    def __init__(self, lines: list[RequestLine]) -> None:
        # The parts joined: each message's content when every line is chat with string
        # contents (the common case, gathered by C iterators: no Python code per line),
        # with each line's messages to tell whose parts they are; else each line's text.
        self.messages: list[Any] | None = None
        try:
            messages = list(map(_MESSAGES, map(_BODY, lines)))
            if all(messages):  # (a line with no message would have no part of its own)
                self.parts = list(map(_CONTENT, chain.from_iterable(messages)))
                text = "\n".join(self.parts)  # a TypeError if a content is not a string
                self.messages = messages
        except (KeyError, TypeError):
            pass
        if self.messages is None:
            self.parts = [prompt_text(line) for line in lines]
            text = "\n".join(self.parts)
        self.data = text.encode()
        self.ascii = len(self.data) == len(text)
        self._ends: list[int] | None = None

    def ends(self) -> list[int]:
        """Where each line's text ends in `data` (where the "\n" after it is, or the end):
        computed only for a chunk where something matched, by C iterators."""
        if self._ends is None:
            lengths = (map(len, self.parts) if self.ascii else
                       map(len, map(str.encode, self.parts)))
            # The end of each part: its length and those of the parts and "\n"s before it.
            part_ends = list(map(add, accumulate(lengths), count()))
            if self.messages is None:
                self._ends = part_ends
            else:  # the end of each line's last part
                last_parts = accumulate(map(len, self.messages), initial=-1)
                next(last_parts)
                self._ends = list(map(part_ends.__getitem__, last_parts))
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
        self.size_rules = [r for r in rules if r.kind == "max_prompt_tokens" and r.max_tokens]
        self.size_floor = min((r.max_tokens for r in self.size_rules), default=0)
        self.counters: dict[str, PromptCounter | None] = {}
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
        indexes = sorted(set(indexes))
        # One rule matching decides, unless it is a term scanned with ASCII edges and the
        # text is not ASCII (on ASCII text those edges are the real ones).
        if len(indexes) == 1 and (self.text_rules[indexes[0]].scan ==
                                  self.text_rules[indexes[0]].exact or data.isascii()):
            return self.text_rules[indexes[0]].rule
        found: Any | None = None
        first = -1
        for i in indexes:
            start = self.text_rules[i].search(data)
            if start is not None and (found is None or start < first):
                found, first = self.text_rules[i].rule, start
        return found

    def screen(self, chunk: list[tuple[int, RequestLine, int]], sink: ViolationSink) -> None:
        """Screen a chunk of lines, each as (line number, line, its prompt-size estimate),
        in one RE2 pass (see CHUNK_TOKENS for its size). Violations go to `sink`, a
        moderation rule's when its lines are embedded: call `flush` at the end."""
        if not chunk:
            return
        refused = self._text_refused(list(map(_LINE, chunk))) if self.text_rules else {}
        if self.moderation:  # every line not refused yet waits for its embedding
            for i, (number, line, tokens) in enumerate(chunk):
                if i in refused:
                    sink(number, line.custom_id, self.violation(refused[i]))
                elif not self._check_size(number, line, tokens, sink):
                    self.pending.append((number, line.custom_id, prompt_text(line)))
            if len(self.pending) >= MODERATION_CHUNK:
                self._moderate(sink)
            return
        # Else only the lines refused and those over a size limit are looked at, in order.
        oversized = self._maybe_oversized(chunk) if self.size_rules else []
        for i in sorted({*refused, *oversized}) if oversized else sorted(refused):
            number, line, tokens = chunk[i]
            if i in refused:
                sink(number, line.custom_id, self.violation(refused[i]))
            else:
                self._check_size(number, line, tokens, sink)

    def _text_refused(self, lines: list[RequestLine]) -> dict[int, Any]:
        """Position in `lines` -> the term or regex rule refusing that line."""
        chunk = _ChunkText(lines)
        # One search of the whole chunk: the lines where a term or regex may match, each
        # then checked on its own; every line is, when a rule uses the text's edges.
        suspects = self._suspects(chunk)
        refused: dict[int, Any] = {}
        for i in range(len(lines)) if self.line_sets else suspects:
            text = chunk.text(i)
            rule = (self.text_match(text) if i in suspects else
                    self._refusing(text, _matching(self.line_sets, text)))
            if rule is not None:
                refused[i] = rule
        return refused

    def _check_size(self, number: int, line: RequestLine, estimate: int,
                    sink: ViolationSink) -> bool:
        """Whether a prompt-size rule refuses the line (then told to `sink`)."""
        if not self.size_rules:
            return False
        counter = self._counter(line.model)
        tokens = (counter.over(line.url, line.body, self.size_floor) if counter else
                  estimate if estimate > self.size_floor else None)
        if tokens is None:
            return False
        for rule in self.size_rules:
            if tokens > rule.max_tokens:
                sink(number, line.custom_id, self.violation(rule))
                return True
        return False

    def _maybe_oversized(self, chunk: list[tuple[int, RequestLine, int]]) -> list[int]:
        """The lines of a chunk a prompt-size rule must look at: over the smallest limit
        by the estimate, or, for models counted exactly, by a loose bound from the
        estimate (`PromptCounter.bound`); the whole chunk clears at once when its largest
        line does."""
        floor = self.size_floor
        largest = max(map(_TOKENS, chunk))
        # Validation lets one model through per batch.
        counter = self._counter(chunk[0][1].model)
        if counter is None:
            if largest <= floor:
                return []
            return [i for i, (_, _, tokens) in enumerate(chunk) if tokens > floor]
        messages = max(map(len, map(_MESSAGES_OR_NONE, map(_BODY, map(_LINE, chunk)))))
        if counter.bound(largest, messages) <= floor:
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
