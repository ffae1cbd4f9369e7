"""No doc cites a measured figure that bench/RESULTS.md does not hold.

What counts as a cited figure (the rule the docs are written to):

- The docs are README.md and docs/*.md, their prose: a paragraph, a list item, a table row
  or a heading, with fenced code left out. CHANGELOG.md is history, figures of their day.
- A paragraph cites a measurement when it names `bench/RESULTS.md` or a `bench/` script,
  says "measured", or names one of RESULTS' machines (Zen 2-5, Xeon, EPYC); so does every
  paragraph under a heading that says "Measured" or "Benchmarks".
- In such a paragraph, outside `inline code`, every number with a unit of measure is a
  cited figure: a ratio (`1.14x`), a percentage, a rate (r/s, tok/s, tokens/s, requests or
  tokens a second), a duration (µs, ms, s, min; `4 min 05 s` is `4:05`) or a size (KB, MB,
  GB, MiB, GiB). Both ends of a range (`14-22 ms`) and each number of a list that ends in
  the unit (`8.2 / 26.3 ms`) are figures with that unit.
- RESULTS holds a figure when it has the same number (sign and thousands separators aside)
  with the same unit, read by the same rule over its whole text (table and method). A rate
  needs only the number: RESULTS' table names the unit in the row (`finished r/s`). A
  figure marked approximate (`~1.4x`) is held by one of the same unit that rounds to it.
- A section of RESULTS a doc names right after `RESULTS.md` (`"Model switch"`, an
  appendix) exists there.

So a doc states what a setting is or does without a unit-bearing figure beside a
measurement, or in a paragraph of its own, and cites a measurement as RESULTS has it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RESULTS = ROOT / "bench" / "RESULTS.md"

NUMBER = r"\d+:\d\d(?!\d)|\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?"
UNIT = (r"(?:x|%|\s?(?:r/s|tok/s|tokens/s|requests a second|tokens a second|µs|ms|s|min"
        r"|KB|MB|GB|MiB|GiB))(?![\w/])")
ITEM = rf"(~)?[+-]?({NUMBER})({UNIT})?"
# Numbers joined by a range's dash or a list's slash share the unit at its end.
GROUP = re.compile(rf"(?<![\w.,/+:-]){ITEM}(?:\s*(?:/|-|–|to)\s*{ITEM})*")
SAME_UNIT = {"requests a second": "r/s", "tokens/s": "tok/s", "tokens a second": "tok/s"}
RATES = {"r/s", "tok/s"}
CITES = re.compile(r"\bbench/|RESULTS\.md|\b[Mm]easured\b|\bZen [2-5]\b|\bXeon\b|\bEPYC\b")
MEASURED = re.compile(r"^#+ .*\b(Measured|Benchmarks)\b")
SECTION = re.compile(r'RESULTS\.md`?\W{0,30}?(?:"([^"]+)"|(appendix \d+))', re.IGNORECASE)

Figure = tuple[bool, str, str]  # (approximate, number, unit)


def figures(text: str) -> list[Figure]:
    """Each number with a unit in `text`, the members of a range or list with theirs."""
    text = re.sub(r"\b(\d+) min (\d\d) s\b", r"\1:\2", text)
    found: list[Figure] = []
    for group in GROUP.finditer(text):
        items = re.findall(ITEM, group.group(0))
        unit = ""
        shared: list[Figure] = []
        for approximate, number, item_unit in reversed(items):
            if ":" in number:
                item_unit = "min:s"
            if item_unit:
                unit = SAME_UNIT.get(item_unit.strip(), item_unit.strip())
            if unit:
                shared.append((approximate == "~", number.replace(",", ""), unit))
        found.extend(reversed(shared))
    return found


def paragraphs(markdown: str) -> list[tuple[str, str]]:
    """The prose of a Markdown file, each with the heading it is under: paragraphs and list
    items joined into one line each, table rows and headings as they are, fenced code left
    out."""
    markdown = re.sub(r"^```.*?^```", "", markdown, flags=re.DOTALL | re.MULTILINE)
    found: list[tuple[str, str]] = []
    heading = ""
    lines: list[str] = []
    for raw in markdown.splitlines():
        line = raw.strip()
        ends = not line or line.startswith(("|", "#")) or re.match(r"([-*]|\d+\.) ", line)
        if ends and lines:
            found.append((heading, " ".join(lines)))
            lines = []
        if line.startswith("#"):
            heading = line
        if line.startswith(("|", "#")):
            found.append((heading, line))
        elif line:
            lines.append(line)
    if lines:
        found.append((heading, " ".join(lines)))
    return found


def cited(markdown: str) -> list[tuple[Figure, str]]:
    """Each figure a doc cites, with its paragraph."""
    return [(figure, paragraph) for heading, paragraph in paragraphs(markdown)
            if CITES.search(paragraph) or MEASURED.search(heading)
            for figure in figures(re.sub(r"`[^`]*`", "CODE", paragraph))]


def held_by(results: str) -> Callable[[Figure], bool]:
    """Whether `results` (RESULTS.md's text) holds a figure, by the rule above."""
    units = {(number, unit) for _, number, unit in figures(results)}
    numbers = {n.replace(",", "") for n in re.findall(rf"(?<![\w.]){NUMBER}", results)}

    def held(figure: Figure) -> bool:
        approximate, number, unit = figure
        if unit in RATES:
            return number in numbers
        if (number, unit) in units:
            return True
        if not approximate or ":" in number:
            return False
        places = len(number.partition(".")[2])
        return any(u == unit and ":" not in n and round(float(n), places) == float(number)
                   for n, u in units)
    return held


def test_every_figure_a_doc_cites_is_in_results() -> None:
    held = held_by(RESULTS.read_text())
    missing = [f"{path.relative_to(ROOT)}: {'~' if approx else ''}{number} {unit}"
               f"  in: {paragraph[:160]}"
               for path in DOCS
               for (approx, number, unit), paragraph in cited(path.read_text())
               if not held((approx, number, unit))]
    assert not missing, "figures bench/RESULTS.md does not hold:\n" + "\n".join(missing)


def test_every_section_of_results_a_doc_names_is_there() -> None:
    results = RESULTS.read_text().lower()
    missing = [f"{path.relative_to(ROOT)}: {name}"
               for path in DOCS for _, paragraph in paragraphs(path.read_text())
               for match in SECTION.finditer(paragraph)
               for name in match.groups() if name and name.lower() not in results]
    assert not missing, "sections bench/RESULTS.md does not have:\n" + "\n".join(missing)


# The rule on the figures the docs cited before they were held to it.
@pytest.mark.parametrize(("text", "found"), [
    ("Measured by `bench/fleet.py`: finished **6,019 requests a second** at 6,000 offered.",
     [(False, "6019", "r/s")]),
    ("Measured on 60 templates x 3 items in a 1 GiB cache: `run_batch` computed 58.9% more.",
     [(False, "1", "GiB"), (False, "58.9", "%")]),
    ("compiled computed 1.14x (Zen 4) / 1.06x (Xeon) end to end, ~1.4x eager's start",
     [(False, "1.14", "x"), (False, "1.06", "x"), (True, "1.4", "x")]),
    ("shard-claim p50 / p99 8.2 / 26.3 ms, p50 14-22 ms on the Xeon",
     [(False, "8.2", "ms"), (False, "26.3", "ms"), (False, "14", "ms"), (False, "22", "ms")]),
    ("a fresh clone takes 4 min 05 s on the Xeon", [(False, "4:05", "min:s")]),
    # Not figures: no unit, a unit inside a word or code, or no measurement named.
    ("64 `batchworker`s on 2-core machines, fp32 and p99, `--seconds 60` on the Xeon", []),
    ("every 2 s with a spread of +-15% per page", []),
    ("## Measured\n\nthe client's p99 grew from 0.13 s to 1.19 s.\n\n## Next\n\nin 20 ms",
     [(False, "0.13", "s"), (False, "1.19", "s")]),
])
def test_what_counts_as_a_cited_figure(text: str, found: list[Figure]) -> None:
    assert [figure for figure, _ in cited(text)] == found


def test_what_results_holds() -> None:
    held = held_by("| Fleet: finished r/s | **5,956** | Zen 4 |\n"
                   "| switch | **5.0 / 25.5 s**; 1.43x, 1.45x | `make check` **4:05** |\n"
                   "per round (1.14/0.82/1.03) and +14.6%")
    assert held((False, "5956", "r/s"))
    assert held((False, "25.5", "s")) and held((False, "5.0", "s"))
    assert held((True, "1.4", "x")) and not held((False, "1.4", "x"))
    assert held((False, "4:05", "min:s"))
    assert held((False, "14.6", "%"))
    assert not held((False, "6019", "r/s"))
    assert not held((False, "1.14", "x"))  # in RESULTS, but not as a ratio marked x
    assert not held((False, "5.0", "ms"))
