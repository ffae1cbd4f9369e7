"""Content policy: the operator's rules (ContentRule, edited in the admin) checked on every
input line while a batch validates.

- `re2rules`: terms and regular expressions (RE2 syntax), decided by RE2; a chunk of lines
  is searched for all of them at once, by one RE2 pass, or on ASCII text by
- `prefilter`: Hyperscan naming the lines and rules to check (bench/policy.py measures
  both).
- `texts`: what both read: a rule's patterns and a chunk's text.
- `size`: the prompt-size rule, in the model's own tokens.
- `moderation`: the moderation rule, an embeddings model and example texts.
- `screener`: all of them on a chunk of lines; `chunker`: how validation cuts the chunks.
- `violation`: what a rule says about a line it refuses.
The admin's check of a regex rule is `jobs.lib.re2check` (the models use it).
"""

from jobs.policy.chunker import CHUNK_TOKENS, LINE_TOKENS, ScreeningChunker
from jobs.policy.embedding_rule import close_engines
from jobs.policy.screener import Screener
from jobs.policy.violation import VIOLATION, Violation

__all__ = [
    "CHUNK_TOKENS",
    "LINE_TOKENS",
    "VIOLATION",
    "Screener",
    "ScreeningChunker",
    "Violation",
    "close_engines",
]
