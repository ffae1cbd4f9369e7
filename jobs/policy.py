"""Content policy: the operator's rules (ContentRule, edited in the admin) checked on every
input line while a batch validates.

Terms and regular expressions are compiled one by one, each with a cheap necessary condition
(a word, a substring, a word length, a digit run: see `_Need`), and only the rules whose
condition a line meets are searched, so the common line costs a split and a few set lookups
rather than a regex search per rule (bench/policy.py measures it). The prompt-size rule
uses the same estimate as the cost preview. A moderation rule embeds each prompt with a
configured embeddings model, through the same engine code as inference, and flags it when
it is close (cosine similarity) to one of the rule's example texts; lines are embedded in
chunks.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.base import EMBEDDINGS, Engine, EngineRequest
from jobs.wire import RequestLine, estimate_tokens

VIOLATION = "content_policy_violation"
MODERATION_CHUNK = 256


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


# --- screening terms and regexes fast ---
#
# Each term or regex rule gets a necessary condition ("need") that is cheap to test on an
# ASCII line: a whole word the line must contain (one set lookup in the line's words) or a
# substring its lowercased text must contain. Only rules whose need is met are searched
# for real, so the common line (no rule matches) costs a translate, a split and a few
# lookups whatever the number of terms. A rule without a usable need is always searched;
# a non-ASCII line searches every rule (case-insensitive matching beyond ASCII has
# equivalences a lowercased copy does not reproduce).

# ASCII letters lowercased, every other ASCII non-word character a space: split() then
# yields the maximal \w runs of an ASCII text, lowercased.
_WORDS_TABLE = bytes(
    (c + 32 if 65 <= c <= 90 else c if (48 <= c <= 57 or 97 <= c <= 122 or c == 95) else 32)
    if c < 128 else c for c in range(256))
_WORD = re.compile(r"\w+", re.ASCII)
_DIGITS = re.compile(r"[0-9]")  # not [0-9]+: a leading class lets re skip to candidates fast
_WORD_CHARS = frozenset("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_")
_ASCII_WORD_CHARS = frozenset(ord(ch) for ch in _WORD_CHARS)


@dataclass(frozen=True)
class _Need:
    words: frozenset[bytes] = frozenset()  # one of these whole words (lowercase)
    texts: tuple[str, ...] = ()  # or one of these substrings of the lowercased text
    # or a whole word at least this long (a pattern that is one word between \b's)
    min_word: int = 0
    # or a match starting where a run of digits starts (a pattern that starts with \b
    # and a digit): tried at those places only
    digit_start: bool = False
    always: bool = False  # no usable condition: always search


_ALWAYS = _Need(always=True)
_MIN_SUBSTRING = 3
_MAX_ALTERNATIVES = 16


def _term_need(term: str) -> _Need:
    if not term.isascii():
        return _ALWAYS
    if _WORD.fullmatch(term):
        return _Need(words=frozenset({term.lower().encode()}))
    return _Need(texts=(term.lower(),))


def _regex_need(pattern: str) -> _Need:
    """A necessary condition of `pattern` (compiled case-insensitively) matching an ASCII
    text, from its parsed form: the best run of required literal characters (a branch of
    literals gives alternatives), as a whole word when word boundaries or spaces surround
    it."""
    from re import _constants as c  # type: ignore[attr-defined]
    from re import _parser  # type: ignore[attr-defined]

    try:
        items = list(_parser.parse(pattern, re.IGNORECASE))
    except (re.error, RecursionError, OverflowError):
        return _ALWAYS

    def literals(item: Any) -> list[str] | None:
        """The strings a literal or a branch of pure literal sequences can match."""
        op, arg = item
        if op is c.LITERAL:
            return [chr(arg)]
        if op is c.BRANCH:
            options = []
            for branch in arg[1]:
                if not branch or any(o is not c.LITERAL for o, _ in branch):
                    return None
                options.append("".join(chr(a) for _, a in branch))
            return options
        return None

    def is_edge(item: Any) -> bool:
        """A word boundary, or a required whitespace character."""
        op, arg = item
        if op is c.AT:
            return arg is c.AT_BOUNDARY
        if op in (c.MAX_REPEAT, c.MIN_REPEAT) and arg[0] >= 1 and len(arg[2]) == 1:
            op, arg = arg[2][0]
        return op is c.IN and arg == [(c.CATEGORY, c.CATEGORY_SPACE)]

    def flat(seq: list[Any]) -> list[Any]:
        out = []
        for op, arg in seq:
            if op is c.SUBPATTERN and not arg[1] and not arg[2]:
                out.extend(flat(list(arg[3])))
            else:
                out.append((op, arg))
        return out

    def wordy(seq: Any) -> bool:
        """Whether every character the items can match is an ASCII word character (on
        ASCII text)."""
        for op, arg in seq:
            if op is c.LITERAL:
                ok = arg in _ASCII_WORD_CHARS
            elif op is c.IN:
                ok = all((o is c.LITERAL and a in _ASCII_WORD_CHARS) or
                         (o is c.RANGE and all(x in _ASCII_WORD_CHARS
                                               for x in range(a[0], a[1] + 1))) or
                         (o is c.CATEGORY and a in (c.CATEGORY_DIGIT, c.CATEGORY_WORD))
                         for o, a in arg)
            elif op in (c.MAX_REPEAT, c.MIN_REPEAT):
                ok = wordy(arg[2])
            elif op is c.SUBPATTERN:
                ok = wordy(arg[3])
            elif op is c.BRANCH:
                ok = all(wordy(b) for b in arg[1])
            else:
                ok = False
            if not ok:
                return False
        return True

    def starts_with_digit(seq: Any) -> bool:
        if not seq:
            return False
        op, arg = seq[0]
        if op is c.IN:
            return all((o is c.CATEGORY and a is c.CATEGORY_DIGIT) or
                       (o is c.RANGE and 48 <= a[0] <= a[1] <= 57) or
                       (o is c.LITERAL and 48 <= a <= 57) for o, a in arg)
        if op is c.LITERAL:
            return 48 <= arg <= 57
        if op in (c.MAX_REPEAT, c.MIN_REPEAT):
            return arg[0] >= 1 and starts_with_digit(arg[2])
        if op is c.SUBPATTERN:
            return starts_with_digit(arg[3])
        return False

    items = flat(items)
    shape: _Need = _ALWAYS
    if items and items[0] == (c.AT, c.AT_BOUNDARY):
        body = items[1:-1] if items[-1] == (c.AT, c.AT_BOUNDARY) else None
        if body and wordy(body) and _parser.SubPattern(
                _parser.State(), body).getwidth()[0] >= 1:
            shape = _Need(min_word=_parser.SubPattern(_parser.State(), body).getwidth()[0])
        elif starts_with_digit(items[1:]):
            shape = _Need(digit_start=True)
    best: _Need = shape
    best_score = 0
    i = 0
    while i < len(items):
        options = literals(items[i])
        if options is None:
            i += 1
            continue
        start = i
        runs = [""]
        while i < len(items) and (options := literals(items[i])) is not None:
            runs = [r + o for r in runs for o in options]
            i += 1
            if len(runs) > _MAX_ALTERNATIVES:
                break
        if len(runs) > _MAX_ALTERNATIVES or not all(r.isascii() for r in runs):
            continue
        bounded = (start > 0 and is_edge(items[start - 1]) and i < len(items)
                   and is_edge(items[i]))
        if bounded and all(_WORD.fullmatch(r) for r in runs):
            need, score = _Need(words=frozenset(r.lower().encode() for r in runs)), 1000
        else:
            need = _Need(texts=tuple(sorted({r.lower() for r in runs})))
            score = min(len(r) for r in runs)
            # A single punctuation character ("-", "@", "$") is still rare in text; a
            # short run of letters is not.
            if score < _MIN_SUBSTRING and not all(
                    len(r) == 1 and not r.isalnum() and not r.isspace() for r in runs):
                continue
        # A short substring is a weaker test than the pattern's shape.
        if score > best_score and (shape.always or score >= _MIN_SUBSTRING):
            best, best_score = need, score
    return best


class Screener:
    def __init__(self, rules: list[Any]) -> None:
        self.rules = {rule.name: rule for rule in rules}
        # Terms and regexes, in rule order: a line is refused by the leftmost match of any
        # of them, the first such rule when several match at the same place (what one
        # alternation of them all would find, but without making the regex engine try
        # every rule at every position of every line).
        self.text_rules: list[tuple[Any, re.Pattern[str], _Need]] = []
        for rule in rules:
            if rule.kind == "term" and rule.pattern.strip():
                term = rule.pattern.strip()
                compiled = re.compile(f"\\b{re.escape(term)}\\b", re.IGNORECASE)
                self.text_rules.append((rule, compiled, _term_need(term)))
            elif rule.kind == "regex" and rule.pattern:
                compiled = re.compile(rule.pattern, re.IGNORECASE)
                self.text_rules.append((rule, compiled, _regex_need(rule.pattern)))
        # Where each rule's need is looked up: by whole word, by substring, or always.
        self.by_word: dict[bytes, list[int]] = {}
        self.by_text: list[tuple[str, int]] = []
        self.always: list[int] = []
        for i, (_, _, need) in enumerate(self.text_rules):
            if need.always:
                self.always.append(i)
            for word in need.words:
                self.by_word.setdefault(word, []).append(i)
            self.by_text.extend((t, i) for t in need.texts)
        self.needed_words = frozenset(self.by_word)
        self.by_length = [(n.min_word, i) for i, (_, _, n) in enumerate(self.text_rules)
                          if n.min_word]
        self.by_digit_start = [i for i, (_, _, n) in enumerate(self.text_rules)
                               if n.digit_start]
        self.size_rules = [r for r in rules if r.kind == "max_prompt_tokens" and r.max_tokens]
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

    def text_match(self, text: str) -> Any | None:
        """The term or regex rule refusing `text`: the leftmost match, the first rule when
        several match at the same place. None when none matches."""
        if text.isascii():
            all_words = text.encode().translate(_WORDS_TABLE).split()
            candidates = set(self.always)
            for word in self.needed_words.intersection(all_words):
                candidates.update(self.by_word[word])
            if self.by_length and all_words:
                longest = max(map(len, all_words))
                candidates.update(i for n, i in self.by_length if longest >= n)
            if self.by_digit_start:
                starts = [m.start() for m in _DIGITS.finditer(text)
                          if not m.start() or text[m.start() - 1] not in _WORD_CHARS]
                if starts:
                    candidates.update(
                        i for i in self.by_digit_start
                        if any(self.text_rules[i][1].match(text, p) for p in starts))
            if self.by_text:
                lowered = text.lower()
                candidates.update(i for t, i in self.by_text if i not in candidates
                                  and t in lowered)
            if not candidates:
                return None
            entries = [self.text_rules[i] for i in sorted(candidates)]
        else:
            entries = self.text_rules
        found: Any | None = None
        first = -1
        for rule, compiled, _ in entries:
            match = compiled.search(text)
            if match is not None and (found is None or match.start() < first):
                found, first = rule, match.start()
        return found

    def check(self, number: int, line: RequestLine, sink: ViolationSink) -> None:
        """Screen one line; violations go to `sink` (moderation ones when their chunk is
        embedded, so call `flush` at the end)."""
        text = prompt_text(line)
        if self.text_rules:
            rule = self.text_match(text)
            if rule is not None:
                sink(number, line.custom_id, self.violation(rule))
                return
        if self.size_rules:
            tokens, _ = estimate_tokens(line)
            for rule in self.size_rules:
                if tokens > rule.max_tokens:
                    sink(number, line.custom_id, self.violation(rule))
                    return
        if self.moderation:
            self.pending.append((number, line.custom_id, text))
            if len(self.pending) >= MODERATION_CHUNK:
                self.flush(sink)

    def flush(self, sink: ViolationSink) -> None:
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
