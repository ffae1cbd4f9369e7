"""Content policy: the operator's rules (ContentRule, edited in the admin) checked on every
input line while a batch validates.

Terms and regular expressions (RE2 syntax) are compiled with RE2 and searched all at once,
in one pass in C over a chunk of lines whatever their number (see "terms and regular
expressions" below; bench/policy.py measures it). The prompt-size rule uses
the same estimate as the cost preview. A moderation rule embeds each prompt with a
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
from operator import itemgetter
from typing import Any

import re2

from engine.base import EMBEDDINGS, Engine, EngineRequest
from jobs.wire import RequestLine, estimate_tokens

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
# Lines are screened a chunk at a time: their texts joined with a separator, one search
# (a DFA in C, linear in the text whatever the number of rules) of an alternation of all
# the term and regex rules. A clean chunk costs that one pass. Each match found names the
# line it starts in, which is then checked on its own with an RE2 set of the same rules
# (which of them match it, and, when several do, whose match is leftmost); the search goes
# on from the next line.
#
# Joining texts loses no match of a rule that cannot tell where a text starts or ends: a
# match inside a line's text is still there in the chunk (RE2 has no lookarounds, and the
# separator is a non-word character, as the start and end of a text are for \b), and a
# match that spans two lines only costs a look at them. Rules that use ^, $, \A or \z are
# set apart and checked line by line.

# A word character, for whole-word terms: a letter, mark or digit in any script, or "_"
# (RE2's \b and \w are ASCII only). Terms are scanned with ASCII edges, which accept more
# (an é next to a term is not a word character to them) and compile a hundred times
# faster; a line they flag is then checked with the real edges.
_NOT_WORD = r"[^\p{L}\p{M}\p{N}_]"
_NOT_ASCII_WORD = "[^0-9A-Za-z_]"
# Lines screened per call into RE2 (enough that the call costs little; the prompt-size
# estimate bounds the text held), their texts joined by a character that texts hardly ever
# hold (an ASCII non-word character, as "\n" is).
CHUNK_LINES = 64
CHUNK_TOKENS = 65_536
_SEP = "\x1e"
_SEP_BYTES = _SEP.encode()
_END = {"content": _SEP}  # a message ending each line of a chunk
# Memory for each set (RE2's default, 8 MiB, is too small for a hundred rules).
_MAX_MEM = 64 << 20
_TOKENS = itemgetter(2)  # of a chunk's (line number, line, tokens)


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


class Screener:
    def __init__(self, rules: list[Any]) -> None:
        self.rules = {rule.name: rule for rule in rules}
        compiled = _text_rules(rules)
        self.text_rules = compiled.rules
        self.chunk_sets = compiled.chunk_sets
        self.line_sets = compiled.line_sets
        self.scanners = compiled.scanners
        # Lines waiting for their chunk to be screened: (line number, line, tokens).
        self.chunk: list[tuple[int, RequestLine, int]] = []
        self.chunk_tokens = 0
        self.size_rules = [r for r in rules if r.kind == "max_prompt_tokens" and r.max_tokens]
        self.size_floor = min((r.max_tokens for r in self.size_rules), default=0)
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
        if len(indexes) == 1 and self.text_rules[indexes[0]].scan == \
                self.text_rules[indexes[0]].exact:
            return self.text_rules[indexes[0]].rule
        found: Any | None = None
        first = -1
        for i in indexes:
            start = self.text_rules[i].search(data)
            if start is not None and (found is None or start < first):
                found, first = self.text_rules[i].rule, start
        return found

    def check(self, number: int, line: RequestLine, sink: ViolationSink, *,
              tokens: int | None = None) -> None:
        """Screen one line; `tokens` is its prompt-size estimate when the caller has it.
        Lines are screened a chunk at a time, and moderation ones when their chunk is
        embedded: violations go to `sink` then, so call `flush` at the end."""
        if tokens is None:
            tokens = estimate_tokens(line)[0] if self.size_rules else 0
        chunk = self.chunk
        chunk.append((number, line, tokens))
        self.chunk_tokens += tokens
        if len(chunk) >= CHUNK_LINES or self.chunk_tokens >= CHUNK_TOKENS:
            self._screen_chunk(sink)

    def _screen_chunk(self, sink: ViolationSink) -> None:
        chunk, self.chunk, self.chunk_tokens = self.chunk, [], 0
        if not chunk:
            return
        refused: dict[int, Any] = {}  # position in the chunk -> term or regex rule
        texts: list[str] | None = None
        if self.text_rules:
            try:  # the common case: chat lines, every content a string
                joined = "\n".join([m["content"] for _, line, _ in chunk
                                    for m in (*line.body["messages"], _END)])
            except (KeyError, TypeError):
                texts = [prompt_text(line) for _, line, _ in chunk]
                joined = "\n".join([part for text in texts for part in (text, _SEP)])
            data = joined.encode()
            # One search of the whole chunk: the lines where a term or regex may match,
            # each then checked on its own. A text holding the separator (or a rule using
            # the text's edges) has every line checked on its own.
            found = self._suspects(data, len(chunk)) if self.scanners else {}
            whole = found is not None
            suspects = found or {}
            for i in (range(len(chunk)) if self.line_sets or not whole else suspects):
                if i in suspects:
                    start, end = suspects[i]
                    rule = self.text_match(data[start:end])
                else:
                    text = (prompt_text(chunk[i][1]) if texts is None else texts[i]).encode()
                    rule = (self._refusing(text, _matching(self.line_sets, text)) if whole
                            else self.text_match(text))
                if rule is not None:
                    refused[i] = rule
        floor = self.size_floor
        if not (refused or self.moderation):  # the common case again
            if self.size_rules and max(map(_TOKENS, chunk)) > floor:
                for number, line, tokens in chunk:
                    if tokens > floor:
                        self._check_size(number, line, tokens, sink)
            return
        for i, (number, line, tokens) in enumerate(chunk):
            if i in refused:
                sink(number, line.custom_id, self.violation(refused[i]))
            elif (not self.size_rules or tokens <= floor or
                  not self._check_size(number, line, tokens, sink)) and self.moderation:
                self.pending.append((number, line.custom_id,
                                     prompt_text(line) if texts is None else texts[i]))
        if len(self.pending) >= MODERATION_CHUNK:
            self._moderate(sink)

    def _check_size(self, number: int, line: RequestLine, tokens: int,
                    sink: ViolationSink) -> bool:
        """Whether a prompt-size rule refuses the line (then told to `sink`)."""
        for rule in self.size_rules:
            if tokens > rule.max_tokens:
                sink(number, line.custom_id, self.violation(rule))
                return True
        return False

    def _suspects(self, data: bytes, lines: int) -> dict[int, tuple[int, int]] | None:
        """The lines of a chunk (each text followed by "\n", _SEP, "\n" in `data`) where a
        term or regex may match, with where each text starts and ends in `data`; None when
        a text holds _SEP itself. A scanner's leftmost match names the line it starts in
        (the "\n" after a separator is the next line's: a term's edge may be that
        character); the search goes on from there."""
        suspects: dict[int, tuple[int, int]] = {}
        ends: list[int] = []  # where each line's separator is, found at the first match
        for scanner in self.scanners:
            position = 0
            while (match := scanner.search(data, position)) is not None:
                if not ends:
                    end = -1
                    for _ in range(lines):
                        end = data.find(_SEP_BYTES, end + 1)
                        ends.append(end)
                    if end != len(data) - 1:
                        return None
                line = bisect.bisect_left(ends, match.start())
                if line >= lines:  # (an empty match at the very end)
                    break
                suspects[line] = (ends[line - 1] + 2 if line else 0, ends[line] - 1)
                position = ends[line] + 1
        return suspects

    def flush(self, sink: ViolationSink) -> None:
        """Screen the lines still waiting."""
        self._screen_chunk(sink)
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
