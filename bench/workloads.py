"""Seeded batch input shapes for the engine benchmarks: lists of OpenAI batch request dicts
(custom_id, POST, /v1/chat/completions, a body with model, messages, max_tokens and
temperature 0), the same for the same arguments. Every request is distinct, so that dedup
cannot make batchweb look better than the engine it runs.

- `shared-prefix`: TEMPLATES task templates, each a long system prompt (instructions, the
  labels, few-shot examples: ~PREFIX_TOKENS tokens of text drawn from seeded words, so two
  templates differ from their first characters), ITEMS short user messages for each, short
  answers (max_tokens 6-8), all items shuffled across the file. The shape of
  classification and extraction files, where vLLM's prefix cache can serve most of the
  prefill, if the requests of a template run close enough together.
- `mixed`: chat requests of one line to a few paragraphs (`harness.make_requests`).
- `long`: short distinct prompts asking for long answers (max_tokens 384-512): decode-bound.

    .venv/bin/python -m bench.workloads shared-prefix [--out FILE.jsonl]

prints the shape's figures (and, with the prepared model, its prompt tokens) and writes
the JSONL file.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path
from typing import Any

try:
    from bench import harness
except ImportError:  # run as `python bench/workloads.py`: bench/ itself is on the path
    import harness  # type: ignore[no-redef]

WORKLOADS = ("mixed", "shared-prefix", "long")

# The sizes of each shape when none is given: count (mixed, long), templates x items and
# prefix tokens (shared-prefix), the max_tokens range.
DEFAULTS: dict[str, dict[str, int]] = {
    "mixed": {"n": 512, "min_tokens": 64, "max_tokens": 256},
    # 60 x ~540 = ~32k distinct prefix tokens: more than the ~23k tokens of KV cache of
    # SmolLM2-135M in float32 at VLLM_CPU_KVCACHE_SPACE=1, so file order evicts prefixes
    # before their template comes back; 240 requests run in minutes on 2 cores.
    "shared-prefix": {"templates": 60, "items": 4, "prefix_tokens": 540, "min_tokens": 6,
                      "max_tokens": 8},
    "long": {"n": 48, "min_tokens": 384, "max_tokens": 512},
}

# Common English words (one token each, mostly, for a Llama-style tokenizer), from which
# the instructions, examples and items are drawn: text that tokenizes like prose.
_NOUNS = """
account action address agent amount answer area article audit balance bank basket bill
board book border branch brand budget building business buyer cable call camera card care
case cash category center chain change channel charge check city claim class client code
color column comment company contract control copy cost country coupon court credit
customer data date deal delay delivery department design detail device discount document
driver email engine entry error event evidence exchange expense factory fee field file
film flight form fund garden goal group guest health history holiday hotel house invoice
issue item job journal key label language law letter level library license line list loan
machine manager map market meeting member message method model money month name network
news note number office order owner package page partner party patient payment period
person phone photo plan policy price problem product profile project property quality
question rate reason receipt record refund region report request result return review
risk road room rule safety sale sample school score screen season section seller service
session share shipment shop signal site size software source staff stage station status
stock store story student subject supplier support system table target tax team term test
text ticket time title topic total track trade train transfer travel trip unit update user
value vendor version video visit warranty water week window word work year zone
"""
_VERBS = """
accept add adjust answer approve assign book cancel change check choose clean close compare
confirm copy count create delete deliver describe detect drop edit estimate explain export
extract fill find fix flag follow group handle ignore import include keep label list load
mark match measure merge move note open order pack pick place plan print read record reject
remove rename repair replace report request reset resolve return review route save scan
select send sort split start stop store summarize tag test track transfer update verify
"""
_ADJECTIVES = """
active annual basic brief broken careful central clear common complete correct current
daily direct early empty exact final formal free full general global important initial
internal late legal local main manual minor missing monthly new normal official old open
original partial personal plain positive previous primary private public quick rare recent
regular related remote short simple single small special standard strict total unknown
urgent usual valid weekly whole wrong
"""
NOUNS, VERBS, ADJECTIVES = _NOUNS.split(), _VERBS.split(), _ADJECTIVES.split()


def _phrase(rng: random.Random) -> str:
    return f"the {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}"


def _sentence(rng: random.Random) -> str:
    return (f"{rng.choice(VERBS).capitalize()} {_phrase(rng)} of each {rng.choice(NOUNS)} "
            f"and {rng.choice(VERBS)} {_phrase(rng)} before you {rng.choice(VERBS)} "
            f"{_phrase(rng)}.")


def _template(rng: random.Random, number: int, opening: str, prefix_tokens: int
              ) -> tuple[str, list[str]]:
    """The system prompt of one task template and its labels. It starts with the
    template's own opening words, so that no two templates share even their first prompt
    block."""
    labels = rng.sample(NOUNS, 4)
    parts = [f"{opening} desk, task {number}. You are the {rng.choice(ADJECTIVES)} "
             f"{rng.choice(NOUNS)} assistant of the {rng.choice(NOUNS)} team. Read the "
             f"message of the user and answer with one label from: {', '.join(labels)}.",
             "Instructions:"]
    # ~4.5 characters a token for this vocabulary (measured with SmolLM2's tokenizer):
    # add instructions, then examples, until the prompt reaches its length.
    target = prefix_tokens * 4.5
    rule = 0
    while sum(map(len, parts)) < target * 0.6:
        rule += 1
        parts.append(f"{rule}. {_sentence(rng)}")
    parts.append("Examples:")
    while sum(map(len, parts)) < target:
        parts.append(f"Message: {_sentence(rng)} {_sentence(rng)}\n"
                     f"Label: {rng.choice(labels)}")
    return "\n".join(parts), labels


def shared_prefix(templates: int, items: int, prefix_tokens: int, min_tokens: int,
                  max_tokens: int, model: str = harness.MODEL, seed: int = 7
                  ) -> list[dict[str, Any]]:
    """TEMPLATES x ITEMS requests: ITEMS distinct items for each template's system prompt,
    shuffled across the file (see the module docstring)."""
    rng = random.Random(seed)
    openings: set[str] = set()
    requests = []
    for t in range(templates):
        # Two seeded words open the prompt; redrawn if another template has them already.
        while (opening := f"{rng.choice(ADJECTIVES).capitalize()} {rng.choice(NOUNS)}"
               ) in openings:
            pass
        openings.add(opening)
        system, _ = _template(rng, t, opening, prefix_tokens)
        for k in range(items):
            item = f"Item {t}-{k}: {_sentence(rng)} {_sentence(rng)}"
            requests.append({
                "custom_id": f"tpl{t}-item{k}", "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": model, "temperature": 0,
                         "max_tokens": rng.randint(min_tokens, max_tokens),
                         "messages": [{"role": "system", "content": system},
                                      {"role": "user", "content": item}]}})
    rng.shuffle(requests)
    return requests


def long_outputs(count: int, min_tokens: int, max_tokens: int, model: str = harness.MODEL,
                 seed: int = 11) -> list[dict[str, Any]]:
    """COUNT short distinct prompts that ask for a long, detailed answer."""
    rng = random.Random(seed)
    requests = []
    for i in range(count):
        topic = rng.choice(harness.TOPICS)
        prompt = (f"Request {i}: write a long and detailed essay about {topic} for a "
                  f"{rng.choice(ADJECTIVES)} {rng.choice(NOUNS)} {rng.choice(NOUNS)}, with "
                  f"sections on {_phrase(rng)}, {_phrase(rng)} and {_phrase(rng)}, each "
                  "explained step by step with examples.")
        requests.append({
            "custom_id": f"long-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "temperature": 0,
                     "max_tokens": rng.randint(min_tokens, max_tokens),
                     "messages": [{"role": "user", "content": prompt}]}})
    return requests


def make(workload: str, model: str = harness.MODEL, **sizes: int | None) -> list[dict]:
    """The requests of WORKLOAD; a size not given (or None) takes its DEFAULTS value."""
    given = {k: v for k, v in sizes.items() if v is not None}
    unknown = set(given) - set(DEFAULTS[workload])
    if unknown:
        raise ValueError(f"{workload} has no size {', '.join(sorted(unknown))}")
    s = {**DEFAULTS[workload], **given}
    if workload == "mixed":
        return harness.make_requests(s["n"], s["min_tokens"], s["max_tokens"], model)
    if workload == "shared-prefix":
        return shared_prefix(s["templates"], s["items"], s["prefix_tokens"],
                             s["min_tokens"], s["max_tokens"], model)
    return long_outputs(s["n"], s["min_tokens"], s["max_tokens"], model)


def describe(requests: list[dict]) -> dict[str, Any]:
    """Figures of a request list: distinct bodies and, when the prepared model's tokenizer
    loads, prompt tokens (chat template applied, as the engine renders them)."""
    bodies = {json.dumps(r["body"], sort_keys=True) for r in requests}
    figures: dict[str, Any] = {
        "requests": len(requests), "distinct": len(bodies),
        "distinct_custom_ids": len({r["custom_id"] for r in requests}),
        "max_tokens_sum": sum(r["body"]["max_tokens"] for r in requests)}
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(harness.ROOT / "var" / "models" /
                                                      harness.MODEL))
    except Exception as e:  # no transformers or no prepared model: no token figures
        figures["tokenizer"] = f"unavailable: {e}"
        return figures
    lengths = [len(tokenizer.apply_chat_template(r["body"]["messages"], tokenize=True,
                                                 add_generation_prompt=True,
                                                 return_dict=True)["input_ids"])
               for r in requests]
    figures.update(prompt_tokens=sum(lengths), prompt_tokens_median=statistics.median(
        lengths))
    systems = {m["content"] for r in requests for m in r["body"]["messages"]
               if m["role"] == "system"}
    if systems:
        sizes = [len(tokenizer(s)["input_ids"]) for s in systems]
        figures.update(templates=len(systems), prefix_tokens_min=min(sizes),
                       prefix_tokens_max=max(sizes), distinct_prefix_tokens=sum(sizes))
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workload", choices=WORKLOADS)
    parser.add_argument("-n", type=int)
    parser.add_argument("--templates", type=int)
    parser.add_argument("--items", type=int)
    parser.add_argument("--prefix-tokens", type=int)
    parser.add_argument("--min-tokens", type=int)
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--out", type=Path, help="write the JSONL file here")
    args = parser.parse_args()
    sizes = {k: getattr(args, k) for k in DEFAULTS[args.workload]}
    requests = make(args.workload, **sizes)
    if args.out:
        args.out.write_bytes(harness.jsonl(requests))
    json.dump(describe(requests), sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    harness.run(main)
