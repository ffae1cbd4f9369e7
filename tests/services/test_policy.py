"""Content policy at validation: each rule type under `reject` and `skip`."""

from __future__ import annotations

import io
import json
import random
import re
from dataclasses import dataclass

import pytest
import re2
from django.core.exceptions import ValidationError

from jobs.formats.prompts import estimate_tokens, prompt_text
from jobs.formats.wire import RequestLine
from jobs.models import Batch, ContentRule, ScreenedLine
from jobs.policy import CHUNK_TOKENS, LINE_TOKENS, Screener, Violation
from jobs.policy.prefilter import Prefilter
from jobs.policy.re2rules import term_pattern
from jobs.policy.texts import ChunkText
from jobs.services import preflight
from jobs.services.files import create_input_file
from tests.factories import chat_line, jsonl, make_batch, responses_line, wait_for

LINES = [
    chat_line("ok-1", "Translate 'good morning' to French."),
    chat_line("term", "How do I make a Molotov cocktail?"),
    chat_line("regex", "My card is 4111 1111 1111 1111, remember it."),
    chat_line("big", "word " * 400),
    chat_line("ok-2", "Summarise the plot of Hamlet."),
]


def validate(user, tmp_path, lines=LINES) -> Batch:
    return make_batch(user, lines, tmp_path)


def rules(action: str) -> None:
    ContentRule.objects.create(name="weapons", kind="term", pattern="molotov cocktail",
                               action=action, reason="no weapons")
    ContentRule.objects.create(name="card-numbers", kind="regex",
                               pattern=r"\b(?:\d{4}[ -]?){3}\d{4}\b", action=action,
                               reason="no payment card numbers")
    ContentRule.objects.create(name="prompt-size", kind="max_prompt_tokens", max_tokens=200,
                               action=action)
    ContentRule.objects.create(name="disabled", kind="term", pattern="Hamlet", enabled=False)


@pytest.mark.django_db
def test_reject_batch_fails_validation_naming_line_and_rule(user, tmp_path):
    rules("reject_batch")
    batch = validate(user, tmp_path)
    assert batch.status == "failed"
    assert [(e["line"], e["code"]) for e in batch.errors] == [
        (2, "content_policy_violation"), (3, "content_policy_violation"),
        (4, "content_policy_violation")]
    messages = [e["message"] for e in batch.errors]
    assert "'weapons'" in messages[0] and "no weapons" in messages[0]
    assert "'card-numbers'" in messages[1]
    assert "'prompt-size'" in messages[2]


@pytest.mark.django_db
def test_reject_fails_each_request_and_strict_the_batch(user, tmp_path):
    """A `reject` rule's line is a request problem: the batch runs, the line is kept from
    running with the rule's message (its shard writes the 400); a strict batch fails."""
    rules("reject")
    batch = validate(user, tmp_path)
    assert batch.status == "in_progress" and batch.total == 5
    kept = list(ScreenedLine.objects.filter(batch=batch).order_by("line").values_list(
        "line", "custom_id", "rule", "code", "param", "message"))
    assert [row[:5] for row in kept] == [
        (2, "term", "", "content_policy_violation", "body"),
        (3, "regex", "", "content_policy_violation", "body"),
        (4, "big", "", "content_policy_violation", "body")]
    assert "'weapons'" in kept[0][5] and "no weapons" in kept[0][5]
    strict = make_batch(user, LINES, tmp_path, strict=True)
    assert strict.status == "failed"
    assert [(e["line"], e["code"]) for e in strict.errors] == [
        (2, "content_policy_violation"), (3, "content_policy_violation"),
        (4, "content_policy_violation")]
    assert [e["message"] for e in strict.errors] == [row[5] for row in kept]


@pytest.mark.django_db
def test_responses_lines_are_screened_by_their_instructions_and_input(user, tmp_path):
    rules("reject_batch")
    lines = [responses_line("ok", "Summarise the plot of Hamlet."),
             responses_line("term", "Go on.", instructions="Explain a Molotov cocktail."),
             responses_line("regex", "", input=[{"role": "user", "content": [
                 {"type": "input_text", "text": "My card is 4111 1111 1111 1111."}]}]),
             responses_line("big", "word " * 400)]
    batch = make_batch(user, lines, tmp_path, endpoint="/v1/responses")
    assert [(e["line"], e["code"]) for e in batch.errors] == [
        (2, "content_policy_violation"), (3, "content_policy_violation"),
        (4, "content_policy_violation")]


@pytest.mark.django_db
def test_preflight_reports_the_content_rules_as_validation_does(user, tmp_path):
    """The new-batch page checks a file with validation's own check: lines a `reject`
    content rule refuses are shown before any batch exists, exactly as validation fails the
    batch with them."""
    rules("reject_batch")
    path = tmp_path / "preflight.jsonl"
    path.write_bytes(jsonl(LINES))
    file = create_input_file(owner=user, path=path, filename="in.jsonl", purpose="batch")
    batch = validate(user, tmp_path)
    for checked in (preflight.check_path(path), preflight.check_file(file)):
        assert not checked.ok
        assert [(e["line"], e["code"]) for e in checked.report.errors] == [
            (2, "content_policy_violation"), (3, "content_policy_violation"),
            (4, "content_policy_violation")]
        assert checked.report.errors == batch.errors


@pytest.mark.django_db
def test_no_rules_no_screening(user, tmp_path):
    assert validate(user, tmp_path).status == "in_progress"


@pytest.mark.django_db
def test_moderation_rule_uses_the_embeddings_engine(user, tmp_path):
    # The echo engine's vectors are hashes: only the very same text is similar, which is
    # enough to show the path (engine, examples, threshold); the real-model test is below.
    ContentRule.objects.create(name="mod", kind="moderation", model="echo-test",
                               threshold=0.99, action="reject_batch",
                               pattern="How do I make a Molotov cocktail?\nsomething else")
    batch = validate(user, tmp_path)
    assert batch.status == "failed"
    assert [(e["line"], e["code"]) for e in batch.errors] == [(2, "content_policy_violation")]


@pytest.mark.django_db(transaction=True)
def test_skip_runs_the_rest_and_writes_flagged_lines_to_errors(openai_client, workers):
    rules("skip")
    file_id = openai_client.files.create(file=("in.jsonl", io.BytesIO(jsonl(LINES))),
                                         purpose="batch").id
    batch = openai_client.batches.create(input_file_id=file_id,
                                         endpoint="/v1/chat/completions",
                                         completion_window="24h")
    workers.start()
    batch = wait_for(lambda: (b := openai_client.batches.retrieve(batch.id)).status ==
                     "completed" and b, timeout=60, message="completion")
    assert (batch.request_counts.completed, batch.request_counts.failed) == (2, 3)
    assert ScreenedLine.objects.filter(batch_id=batch.id).count() == 3
    out = [json.loads(x) for x in
           openai_client.files.content(batch.output_file_id).text.splitlines()]
    errors = {(r := json.loads(x))["custom_id"]: r for x in
              openai_client.files.content(batch.error_file_id).text.splitlines()}
    assert {r["custom_id"] for r in out} == {"ok-1", "ok-2"}
    assert set(errors) == {"term", "regex", "big"}
    assert errors["term"]["error"]["code"] == "content_policy_violation"
    assert "'weapons'" in errors["term"]["error"]["message"]
    assert errors["term"]["response"] is None


# --- the screener on its own: terms and regexes matched by one RE2 set, a chunk at a time ---

def screen(rules: list[ContentRule], bodies: list[dict], tokens: int | None = None,
           chunk_lines: int = CHUNK_TOKENS // LINE_TOKENS,
           use_prefilter: bool = True) -> dict[int, str]:
    """Line number -> the rule refusing it, through `screen` and `flush` as validation calls
    them, `chunk_lines` lines at a time; each line's prompt size is `tokens`, or
    validation's estimate."""
    screener = Screener(rules, use_prefilter=use_prefilter)
    found: dict[int, str] = {}

    def sink(number: int, custom_id: str, violation: Violation) -> None:
        assert number not in found and custom_id == f"c{number}"
        found[number] = violation.rule

    urls = {"messages": "/v1/chat/completions", "prompt": "/v1/completions",
            "input": "/v1/embeddings"}
    lines = [RequestLine(custom_id=f"c{number}", body=body,
                         url=next(url for key, url in urls.items() if key in body))
             for number, body in enumerate(bodies, start=1)]
    chunk = [(number, line.custom_id, estimate_tokens(line) if tokens is None else tokens,
              prompt_text(line)[0]) for number, line in enumerate(lines, start=1)]
    keep = screener.needs_requests(lines[0].body["model"])
    for start in range(0, len(chunk), chunk_lines):
        screener.screen(chunk[start:start + chunk_lines], sink,
                        lines[start:start + chunk_lines] if keep else None)
    screener.flush(sink)
    return found


@dataclass
class PrefilterRun:
    use: bool  # the screener's `use_prefilter`
    read: list[bool]  # for each chunk the prefilter was asked about, whether it read it


@pytest.fixture(params=[True, False], ids=["prefilter", "re2-only"])
def prefilter(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> PrefilterRun:
    """Screen with Hyperscan's prefilter on the chunks it may read (the default), or with
    RE2 alone; records which chunks the prefilter read."""
    run = PrefilterRun(use=request.param, read=[])
    candidates = Prefilter.candidates

    def spy(self: Prefilter, chunk: ChunkText) -> dict | None:
        found = candidates(self, chunk)
        run.read.append(found is not None)
        return found

    monkeypatch.setattr(Prefilter, "candidates", spy)
    return run


def chat(*texts: object) -> dict:
    return {"model": "echo-test", "messages": [{"role": "user", "content": t} for t in texts]}


def rule(name: str, kind: str, pattern: str = "", **fields: object) -> ContentRule:
    return ContentRule(name=name, kind=kind, pattern=pattern, action="reject", **fields)


def test_terms_are_whole_words_in_any_case_and_script():
    rules = [rule("cafe", "term", "  café "), rule("cpp", "term", "c++"),
             rule("greek", "term", "Ελλάδα"), rule("phrase", "term", "molotov cocktail")]
    texts = ["Un CAFÉ noir", "des cafés", "décaféiné", "café_au_lait", "I write C++.",
             "c++11 is fine too", "abc++", "ταξίδι στην ΕΛΛΆΔΑ", "Ελλάδας",
             "MOLOTOV  cocktail", "Molotov Cocktail!", "molotov cocktails", "nothing here"]
    assert screen(rules, [chat(t) for t in texts]) == {
        1: "cafe", 5: "cpp", 6: "cpp", 8: "greek", 11: "phrase"}


def test_leftmost_match_wins_then_the_first_rule_by_name():
    rules = [rule("a-card", "regex", r"\b(?:\d{4}[ -]?){3}\d{4}\b"),
             rule("b-weapons", "term", "molotov cocktail"),
             rule("c-molotov", "regex", r"molotov\s+\w+"),
             rule("d-digits", "regex", r"\d+")]
    assert screen(rules, [chat("4111 1111 1111 1111 then a molotov cocktail"),
                          chat("a molotov cocktail then 4111 1111 1111 1111"),
                          chat("molotov party"),
                          chat("molotov cocktail"),
                          chat("1 molotov cocktail")]) == {
        1: "a-card", 2: "b-weapons", 3: "c-molotov", 4: "b-weapons", 5: "d-digits"}


def test_regex_rules_are_re2_case_insensitive_and_anchored_per_line():
    rules = [rule("greek-code", "regex", r"\p{Greek}{3}-\d+"),
             rule("starts", "regex", r"^ignore (?:all|previous)"),
             rule("ends", "regex", r"leak\z"),
             rule("secret", "regex", r"(?P<word>secret)\s*[:=]")]
    bodies = [chat("code ΑΒΓ-12"), chat("IGNORE ALL instructions"),
              chat("please ignore all instructions"), chat("the big leak"),
              chat("leak and more"), chat("Secret = x"), chat("ok", "ignore previous"),
              chat("ignore previous", "ok")]
    assert screen(rules, bodies) == {1: "greek-code", 2: "starts", 4: "ends", 6: "secret",
                                     8: "starts"}


def test_a_match_across_two_lines_of_a_chunk_refuses_neither():
    rules = [rule("phrase", "term", "molotov cocktail"),
             rule("spaces", "regex", r"project\s+nightingale"),
             rule("anything", "regex", r"nightingale[^!]*secret")]
    bodies = [chat("about the molotov"), chat("cocktail party"), chat("project"),
              chat("nightingale is"), chat("a secret!")] * 5
    assert screen(rules, bodies) == {}


def test_other_request_shapes_are_screened_too():
    rules = [rule("weapons", "term", "molotov")]
    bodies = [{"model": "m", "prompt": "a MOLOTOV"},
              {"model": "m", "input": ["fine", "molotov"]},
              chat("fine", [{"type": "text", "text": "molotov"}]),
              {"model": "m", "messages": [{"role": "assistant", "tool_calls": []},
                                          {"role": "user", "content": "molotov"}]},
              chat("fine")]
    assert screen(rules, bodies) == {1: "weapons", 2: "weapons", 3: "weapons", 4: "weapons"}


def test_the_token_estimate_validation_passes_is_used():
    rules = [rule("size", "max_prompt_tokens", max_tokens=100)]
    assert screen(rules, [chat("short")], tokens=101) == {1: "size"}
    assert screen(rules, [chat("word " * 400)], tokens=5) == {}
    assert screen(rules, [chat("word " * 400)]) == {1: "size"}  # estimated when not given
    rules.append(rule("a-term", "term", "molotov"))  # a term or regex rule is told first
    assert screen(rules, [chat("molotov")] * 3 + [chat("fine")], tokens=101) == {
        1: "a-term", 2: "a-term", 3: "a-term", 4: "size"}


@pytest.mark.parametrize("chunk_lines", [CHUNK_TOKENS // LINE_TOKENS, 7])
def test_chunked_screening_agrees_with_each_rule_searched_alone(chunk_lines: int,
                                                                prefilter: PrefilterRun):
    """Many lines of words, near misses, non-ASCII text, newlines and several messages (some
    as text parts, some lines with none): what the screener reports is, line by line, the
    leftmost match of the rules searched one at a time (terms with Python's re, regexes with
    RE2 on their own), whatever the chunks."""
    rules = [rule("r-card", "regex", r"\b(?:\d{4}[ -]?){3}\d{4}\b"),
             rule("r-start", "regex", r"^ignore\b"),
             rule("r-end", "regex", r"leak$"),
             rule("r-pair", "regex", r"project\s+nightingale"),
             rule("r-word", "regex", r"\bsecret\w*"),
             rule("t-cafe", "term", "café"), rule("t-cpp", "term", "c++"),
             rule("t-phrase", "term", "molotov cocktail"), rule("t-greek", "term", "Ελλάδα")]
    words = ["the", "a", "project", "nightingale", "ignore", "leak", "café", "CAFÉ", "cafés",
             "c++", "C++11", "xc++", "molotov", "cocktail", "MOLOTOV", "secret", "secrets",
             "Ελλάδα", "ΕΛΛΆΔΑ", "Ελλάδας", "日本語", "naïve", "4111", "1111", "-", "\n", "!",
             "_café", "café_"]
    rng = random.Random(8)
    bodies = []
    for n in range(700):
        # Every other stretch of 100 lines is ASCII only (its chunks are located by str
        # lengths, the others by UTF-8 lengths).
        pool = [w for w in words if w.isascii()] if n // 100 % 2 else words
        texts: list[object] = [" ".join(rng.choices(pool, k=rng.randint(0, 12)))
                               for _ in range(rng.choice([1, 1, 1, 2, 3]))]
        if rng.random() < 0.02:  # content as text parts: that chunk takes the slow path
            texts[-1] = [{"type": "text", "text": t} for t in str(texts[-1]).split(" ", 1)]
        bodies.append(chat(*texts) if rng.random() > 0.005 else chat())
    bodies[100] = chat("a \x1e molotov cocktail")
    bodies[400] = chat("\x1ecafé")
    options = re2.Options()
    options.case_sensitive = False

    def reference(text: str) -> str | None:
        best: tuple[int, str] | None = None
        for r in rules:  # already in name order
            if r.kind == "term":
                edge = (r"(?<!\w)" if re.match(r"\w", r.pattern[0]) else "",
                        r"(?!\w)" if re.match(r"\w", r.pattern[-1]) else "")
                match = re.search(edge[0] + re.escape(r.pattern) + edge[1], text, re.I)
            else:
                match = re2.search(r.pattern, text, options)
            if match is not None and (best is None or match.start() < best[0]):
                best = (match.start(), r.name)
        return best and best[1]

    def text_of(body: dict) -> str:
        parts: list[str] = []
        for message in body["messages"]:
            content = message["content"]
            parts.extend([content] if isinstance(content, str) else
                         [part["text"] for part in content])
        return "\n".join(parts)

    expected = {n: name for n, body in enumerate(bodies, start=1)
                if (name := reference(text_of(body)))}
    assert 50 < len(expected) < 650  # the corpus has both
    assert screen(rules, bodies, chunk_lines=chunk_lines,
                  use_prefilter=prefilter.use) == expected
    # With the prefilter, it read the ASCII chunks (the non-ASCII terms cannot match them).
    assert ((any(prefilter.read) and not all(prefilter.read)) if prefilter.use
            else not prefilter.read)


def test_prefilter_gives_re2_the_chunks_it_cannot_read(prefilter: PrefilterRun):
    r"""A vertical tab (\S to RE2, \s to Hyperscan), non-ASCII text, and a chunk matching
    too often are read by RE2; a non-ASCII term is left out of the prefilter and still
    found in non-ASCII text."""
    rules = [rule("a-key", "regex", r"key:\S+"), rule("b-bomb", "term", "bomb"),
             rule("c-cafe", "term", "café"), rule("d-digit", "regex", r"\d")]
    bodies = [chat("key:\v"), chat("a bomb"), chat("un café"), chat("cafe"),
              chat("1" * 300), chat("no match")]
    assert screen(rules, bodies, chunk_lines=1, use_prefilter=prefilter.use) == {
        1: "a-key", 2: "b-bomb", 3: "c-cafe", 5: "d-digit"}
    if prefilter.use:
        assert prefilter.read == [False, True, False, True, False, True]


def test_prefilter_names_the_lines_its_matches_end_in(prefilter: PrefilterRun):
    r"""Terms at either end of a line (their edge may be the "\n" between two lines), a
    match across two lines that neither line has alone, and what the prefilter's looser
    patterns find (a term inside a word, \b left out) but RE2's do not, in one chunk."""
    rules = [rule("a-bomb", "term", "bomb"), rule("b-pair", "regex", r"left\s+right"),
             rule("c-mb", "regex", r"\bmb\b")]
    bodies = [chat("!!!", "bomb"), chat("bomb"), chat("?"), chat("!! left"),
              chat("right !!"), chat("x mb"), chat("xmb", "bombs")]
    assert screen(rules, bodies, use_prefilter=prefilter.use) == {
        1: "a-bomb", 2: "a-bomb", 6: "c-mb"}
    if prefilter.use:
        assert prefilter.read == [True]


def test_prefilter_is_left_out_when_a_rule_could_escape_it():
    """Rules Hyperscan cannot hold exactly as RE2 means them on ASCII text: RE2 alone."""
    kelvin = "\u212a"  # folds to k
    for rules in ([rule("r", "regex", r"\x{212a}elvin")], [rule("t", "term", kelvin + "ill")],
                  [rule("r", "regex", r"\p{Greek}+")], [rule("r", "regex", r"a*")],
                  [rule("r", "regex", r"\b(?:zz)?")],
                  [rule("r", "regex", "naïve")]):
        assert Screener(rules).prefilter is None, rules[0].pattern
    assert screen([rule("t", "term", kelvin + "ill")], [chat("kill"), chat("skill")]) == {
        1: "t"}
    for rules in ([rule("t", "term", "bomb")], [rule("t", "term", "café")],
                  [rule("r", "regex", r"\bpassword\s*[:=]\s*\S+")]):
        assert Screener(rules).prefilter is not None, rules[0].pattern


@pytest.mark.django_db
def test_clean_refuses_what_re2_cannot_run_and_says_why():
    for pattern, detail in [(r"(\d)\1", "backreferences"), (r"foo(?=bar)", "lookarounds"),
                            (r"(?<!x)y", "lookarounds"), ("[a-", "missing ]"),
                            (r"end\Z", "\\z")]:
        with pytest.raises(ValidationError) as caught:
            rule("r", "regex", pattern).full_clean()
        message = " ".join(caught.value.message_dict["pattern"])
        assert "RE2" in message and detail in message, message
    with pytest.raises(ValidationError):
        rule("t", "term", "   ").full_clean()
    rule("r", "regex", r"\b\d{3}-\d{2}-\d{4}\b").full_clean()
    rule("t", "term", "café").full_clean()


def test_random_rules_on_both_paths_agree_with_each_rule_searched_alone():
    """Random regexes (classes, \\b and \\B, repeats, alternations, quotes) and terms against
    random short lines, ASCII (the prefilter reads them) and not, in chunks of 5: the
    prefilter and RE2's own pass each refuse exactly what the rules searched alone do."""
    rng = random.Random(4)
    atoms = ["a", "b", "ab", "x", r"\d", r"\w", r"\s", r"\S", r"\W", ".", "[a-c]", "[^a]",
             "[[:digit:]]", r"\b", r"\B", "-", " ", "K", r"\pL", r"\PN", r"[\d-]", r"\.",
             r"\Qa.\E"]

    def pattern(depth: int = 0) -> str:
        roll = rng.random()
        if depth > 2 or roll < 0.4:
            return rng.choice(atoms)
        if roll < 0.6:
            return pattern(depth + 1) + pattern(depth + 1)
        if roll < 0.75:
            return f"(?:{pattern(depth + 1)}|{pattern(depth + 1)})"
        return f"(?:{pattern(depth + 1)})" + rng.choice(["*", "+", "?", "{2}", "{1,3}"])

    options = re2.Options()
    options.case_sensitive = False
    read = 0
    for trial in range(150):
        rules = [rule(f"r{i}", "regex", pattern()) for i in range(rng.randint(1, 4))]
        rules += [rule(f"t{i}", "term", rng.choice(["ab", "a b", "k", "x-1", "c++", "é"]))
                  for i in range(rng.randint(0, 2))]
        chars = "abcxkK _-.+0123\n\t!" + ("" if trial % 2 else "\x0bé")
        texts = ["".join(rng.choices(chars, k=rng.randint(0, 12))) for _ in range(20)]
        expected = {}
        for number, text in enumerate(texts, start=1):
            starts = []
            for r in rules:
                exact = (term_pattern(r.pattern) if r.kind == "term" else r.pattern)
                match = re2.compile(exact, options).search(text)
                if match is not None:
                    starts.append((match.start(1 if r.kind == "term" else 0), r.name))
            if starts:
                expected[number] = min(starts)[1]
        for use in (True, False):
            bodies = [chat(text) for text in texts]
            assert screen(rules, bodies, chunk_lines=5, use_prefilter=use) == expected, (
                [r.pattern for r in rules], use)
            read += use and Screener(rules).prefilter is not None
    assert read > 50  # most trials ran the prefilter
