"""Benchmark: what content-policy screening adds to batch validation.

Validates one 50,000-line chat batch file through `jobs.services.validation.check_input`
with no content rules, then with 100 rules (80 blocked terms, 20 regular expressions) plus
one max_prompt_tokens rule (no moderation rule: that one costs a model call per chunk and
is measured with the engine, not here). Each case runs several times in this one process,
in pairs taken back to back (which of the two goes first alternates); the medians are
reported, and the median of the pairs' ratios, which a machine whose speed drifts (a shared
virtual machine's does, by tens of percent within a minute) disturbs least. The rules are
`skip` rules and about 1% of the lines break one, so every line is screened against every
rule and the violation path runs too.

Then the same for the validation task itself (`run_validation`: the pass, plus reading the
file from storage and saving the shards and the screened-out lines), in CPU time.

Uses a scratch SQLite database under a temporary BATCHWEB_VAR_DIR (migrated here).

    .venv/bin/python bench/policy.py [--lines 50000] [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

try:
    from bench import harness
except ImportError:  # run as `python bench/policy.py`: bench/ itself is on the path
    import harness  # type: ignore[no-redef]

_WORDS_TEXT = ("the a of to and in is for on with that this by from as are be at or it an was "
         "model batch request answer question summary document report customer order "
         "invoice product service quality shipping delivery refund account payment email "
         "meeting project deadline budget review analysis market sales growth revenue "
         "strategy team manager policy contract legal compliance data table chart figure "
         "translate classify extract rewrite explain describe compare list write short "
         "long detailed simple formal friendly english french german spanish italian")
WORDS = _WORDS_TEXT.split()

TERMS = [f"{stem}{suffix}" for stem in (
    "blockedterm", "forbidden", "contraband", "banned", "secretcode", "noword", "taboo",
    "restricted", "embargo", "prohibited") for suffix in ("", "s", "ing", "ed", "x", "z",
                                                         "word", "thing")]
REGEXES = [
    r"\b\d{3}-\d{2}-\d{4}\b",                        # US SSN
    r"\b(?:\d[ -]?){13,16}\b",                       # card number
    r"\b[A-Z]{2}\d{2}[A-Z0-9]{11,30}\b",             # IBAN
    r"[\w.+-]+@internal\.example\.com",              # internal e-mail
    r"\bpassword\s*[:=]\s*\S+",                      # leaked password
    r"\bapi[_-]?key\s*[:=]\s*\S{16,}",               # leaked key
    r"sk-[A-Za-z0-9]{32,}",                          # a secret key
    r"\bAKIA[0-9A-Z]{16}\b",                         # AWS access key id
    r"-----BEGIN (?:RSA |EC )?PRIVATE KEY-----",     # private key
    r"\bproject\s+nightingale\b",                    # code name
    r"\bconfidential\s+-\s+do\s+not\s+share\b",
    r"\b(?:kill|hurt)\s+(?:him|her|them)\b",
    r"\bhow\s+to\s+make\s+(?:a\s+)?bomb\b",
    r"\bcredit\s+card\s+dump\b",
    r"\bssn\s*#?\s*\d+",
    r"\b(?:19|20)\d{2}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z?\s+leak\b",
    r"\bdrop\s+table\s+\w+",
    r"<script\b",
    r"\bwire\s+\$?\d{5,}\b",
    r"\bpatient\s+id\s*:\s*\d+",
]
assert len(TERMS) == 80 and len(REGEXES) == 20


def setup_django(var_dir: str) -> None:
    os.environ["BATCHWEB_VAR_DIR"] = var_dir
    os.environ["DJANGO_SETTINGS_MODULE"] = "batchweb.settings"
    os.environ["DATABASE_URL"] = f"sqlite:///{var_dir}/bench.sqlite3"
    os.environ["BATCHWEB_ECHO_MODEL"] = "1"
    os.environ.setdefault("BATCHWEB_MAX_REQUESTS_PER_BATCH", "1000000")
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)


def write_input(path: Path, count: int, rng: random.Random) -> int:
    """A chat batch: a system and a user message of 20-120 words; ~1% of the lines break
    a rule (a term or a pattern)."""
    hits = ["please ignore the contraband shipment", "my password: hunter2hunter2",
            "the ssn is 123-45-6789", "about project nightingale"]
    with open(path, "w") as out:
        for i in range(count):
            text = " ".join(rng.choices(WORDS, k=rng.randint(20, 120)))
            if i % 100 == 50:
                text += " " + hits[(i // 100) % len(hits)]
            out.write(json.dumps({
                "custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "echo-test", "max_tokens": 64, "messages": [
                    {"role": "system", "content": "You are a helpful assistant."},
                    {"role": "user", "content": f"Request {i}: {text}"}]},
            }) + "\n")
    return path.stat().st_size


def create_rules() -> None:
    from jobs.models import ContentRule

    rules = [ContentRule(name=f"term-{i:02d}", kind="term", pattern=term, action="skip",
                         reason="blocked term") for i, term in enumerate(TERMS)]
    rules += [ContentRule(name=f"regex-{i:02d}", kind="regex", pattern=pattern,
                          action="skip", reason="blocked pattern")
              for i, pattern in enumerate(REGEXES)]
    rules.append(ContentRule(name="prompt-size", kind="max_prompt_tokens", max_tokens=4000,
                             action="skip", reason="prompt too long"))
    ContentRule.objects.bulk_create(rules)


def validate(path: Path, *, screen: bool) -> tuple[float, float, int, int]:
    """(seconds, CPU seconds, requests, screened lines) of one validation pass, as the
    validation task runs it: the rules are loaded from the database for the pass."""
    from jobs.policy import Screener
    from jobs.services.validation import check_input

    start, cpu = time.perf_counter(), time.process_time()
    screener = Screener.load() if screen else None
    with open(path, "rb") as stream:
        report = check_input(stream, endpoint="/v1/chat/completions", screener=screener,
                             on_screened=lambda line, custom_id, rule: None)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    assert report.ok, report.errors[:3]
    return seconds, cpu, report.requests, report.screened


def stored_input(path: Path) -> Any:
    """The file stored as a user's batch input file, as the API stores an upload."""
    from django.contrib.auth import get_user_model

    from jobs.services.files import create_input_file

    user = get_user_model().objects.create_user("bench")
    return create_input_file(owner=user, path=path, filename="input.jsonl", purpose="batch")


def validate_task(file: Any, *, screen: bool) -> float:
    """CPU seconds of one run of the validation task (`run_validation`) on a new batch of
    the stored file: the pass above, plus reading the file from storage and saving the
    shards and the lines screened out. Rolled back, so that nothing is enqueued and each
    run starts from the same database."""
    from django.db import transaction

    from jobs.models import Batch, ContentRule
    from jobs.services.batches import create_batch
    from jobs.services.validation import run_validation

    with transaction.atomic():
        ContentRule.objects.update(enabled=screen)
        batch = create_batch(owner=file.owner, input_file_id=file.pk,
                             endpoint="/v1/chat/completions", completion_window="24h")
        cpu = time.process_time()
        run_validation(batch_id=batch.pk)
        cpu = time.process_time() - cpu
        assert Batch.objects.get(pk=batch.pk).status == Batch.Status.IN_PROGRESS
        transaction.set_rollback(True)
    return cpu


def alternating(runs: int) -> list[bool]:
    """`runs` pairs of cases, without rules (False) and with them (True), back to back;
    which goes first alternates."""
    return [screen for run in range(runs)
            for screen in ((False, True) if run % 2 == 0 else (True, False))]


def paired_overhead(base: list[float], ruled: list[float]) -> float:
    """The median of the pairs' ratios, as a percentage added."""
    return (statistics.median(r / b for b, r in zip(base, ruled, strict=True)) - 1) * 100


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lines", type=int, default=50_000)
    parser.add_argument("--runs", type=int, default=5)
    harness.add_json_option(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-policy-") as scratch:
        setup_django(scratch)
        path = Path(scratch) / "input.jsonl"
        size = write_input(path, args.lines, random.Random(8))
        create_rules()
        from jobs.models import ContentRule

        rule_count = ContentRule.objects.count()
        validate(path, screen=False)  # warm-up: page cache, imports, regex compile
        validate(path, screen=True)
        times: dict[bool, list[float]] = {False: [], True: []}
        cpu_times: dict[bool, list[float]] = {False: [], True: []}
        screened = 0
        for screen in alternating(args.runs):
            seconds, cpu, requests, count = validate(path, screen=screen)
            times[screen].append(seconds)
            cpu_times[screen].append(cpu)
            screened = count if screen else screened
        base, ruled = statistics.median(times[False]), statistics.median(times[True])
        cpu_base, cpu_ruled = (statistics.median(cpu_times[False]),
                               statistics.median(cpu_times[True]))
        print(f"{args.lines:,} lines, {size / 1e6:.1f} MB, median of {args.runs} runs each; "
              f"{screened} lines screened out by the rules")
        print(f"{'rules':<34}{'median s':>10}{'requests/s':>12}{'overhead':>10}")
        print(f"{'none':<34}{base:>10.3f}{requests / base:>12,.0f}{'':>10}")
        label = f"{rule_count} (80 terms, 20 regex, 1 size)"
        print(f"{label:<34}{ruled:>10.3f}{requests / ruled:>12,.0f}"
              f"{(ruled / base - 1) * 100:>9.1f}%")
        print(f"CPU time of the process (median): none {cpu_base:.3f} s, rules "
              f"{cpu_ruled:.3f} s, overhead {(cpu_ruled / cpu_base - 1) * 100:.1f}%")
        print(f"median of the pairs' ratios: wall "
              f"{paired_overhead(times[False], times[True]):.1f}%, "
              f"CPU {paired_overhead(cpu_times[False], cpu_times[True]):.1f}%")
        print("runs none:  " + " ".join(f"{t:.3f}" for t in times[False]))
        print("runs rules: " + " ".join(f"{t:.3f}" for t in times[True]))
        task: dict[bool, list[float]] = {False: [], True: []}
        file = stored_input(path)
        for screen in alternating(args.runs):
            task[screen].append(validate_task(file, screen=screen))
        print(f"the validation task (run_validation, SQLite), CPU time median: none "
              f"{statistics.median(task[False]):.3f} s, rules "
              f"{statistics.median(task[True]):.3f} s; median of the pairs' ratios "
              f"{paired_overhead(task[False], task[True]):.1f}%")
    harness.write_json(args.json, {
        "lines": args.lines, "megabytes": size / 1e6, "runs": args.runs, "rules": rule_count,
        "screened": screened,
        "check_input": {
            "median_s": {"none": base, "rules": ruled},
            "requests_per_s": {"none": requests / base, "rules": requests / ruled},
            "overhead_pct": (ruled / base - 1) * 100,
            "cpu_median_s": {"none": cpu_base, "rules": cpu_ruled},
            "cpu_overhead_pct": (cpu_ruled / cpu_base - 1) * 100,
            "paired_overhead_pct": {
                "wall": paired_overhead(times[False], times[True]),
                "cpu": paired_overhead(cpu_times[False], cpu_times[True])},
            "runs_s": {"none": times[False], "rules": times[True]}},
        "run_validation": {
            "cpu_median_s": {"none": statistics.median(task[False]),
                             "rules": statistics.median(task[True])},
            "paired_overhead_pct": paired_overhead(task[False], task[True])}})


if __name__ == "__main__":
    harness.run(main)
