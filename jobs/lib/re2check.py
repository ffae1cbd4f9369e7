"""RE2 as content rules use it: the options every rule is compiled with, and the check the
admin runs on a regex rule before saving it (`ContentRule.clean`).

It imports nothing of the project, so the models and the content policy (`jobs.policy`,
which reads the models) can both use it.
"""

from __future__ import annotations

import re2

# Memory for each set (RE2's default, 8 MiB, is too small for a hundred rules).
MAX_MEM = 64 << 20


def options() -> re2.Options:
    """Case-insensitive, quiet, with room for a hundred rules in one set."""
    result = re2.Options()
    result.case_sensitive = False
    result.log_errors = False
    result.max_mem = MAX_MEM
    return result


def error_text(exc: Exception) -> str:
    """RE2's reason for refusing a pattern, as text."""
    detail = exc.args[0] if exc.args else ""
    return detail.decode(errors="replace") if isinstance(detail, bytes) else str(detail)


def regex_problem(pattern: str) -> str | None:
    """Why `pattern` cannot be a regex rule (RE2 syntax), or None when it can."""
    try:
        re2.compile(pattern, options())
        alone = re2.Set.SearchSet(options())
        alone.Add(pattern)
        alone.Compile()
    except re2.error as exc:
        detail = error_text(exc)
        if detail.startswith("failed to compile"):
            detail = "the expression is too large"
        return (f"Not a regular expression RE2 accepts ({detail}). RE2 has no "
                "backreferences (\\1, (?P=name)) and no lookarounds ((?=…), (?!…), (?<=…), "
                "(?<!…)); write \\z, not \\Z, for the end of the text.")
    return None
