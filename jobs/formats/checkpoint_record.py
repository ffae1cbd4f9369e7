"""What a shard attempt has saved so far, as the Shard row's `checkpoint` holds it: its
part files' stored segments, the input lines they answer, and the counters they carry
(Progress, ShardUsage). Written by the worker under its attempt (jobs.services.shards),
adopted by the next attempt, and read by the result pages while the batch runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jobs.models import SHARD_PROGRESS_FIELDS

# Per model: requests succeeded, input tokens, cached input tokens, output tokens, reasoning
# tokens (of the output ones; absent from checkpoints written before they were counted).
ModelCounts = list[int]
MODEL_COUNTS = 5


@dataclass
class ShardUsage:
    """What a shard attempt used beyond its Progress: the counters of requests that ran on a
    LoRA adapter (by adapter name; the rest ran on the batch's model), and the engine's time
    its requests took. Carried in checkpoints, so a resumed attempt keeps them."""

    adapters: dict[str, ModelCounts] = field(default_factory=dict)
    engine_seconds: float = 0.0

    def __post_init__(self) -> None:
        # Counts kept before reasoning tokens were counted have four: none reasoned.
        self.adapters = {k: [*v, *[0] * (MODEL_COUNTS - len(v))]
                         for k, v in self.adapters.items()}

    def add(self, model: str, *, requests: int, input_tokens: int, cached_tokens: int,
            output_tokens: int, reasoning_tokens: int = 0) -> None:
        counts = self.adapters.setdefault(model, [0] * MODEL_COUNTS)
        for index, value in enumerate((requests, input_tokens, cached_tokens, output_tokens,
                                       reasoning_tokens)):
            counts[index] += value

    def as_json(self) -> dict[str, Any]:
        return {"adapters": {k: list(v) for k, v in self.adapters.items()},
                "engine_seconds": self.engine_seconds}

    @classmethod
    def from_json(cls, value: dict[str, Any] | None) -> ShardUsage:
        value = value or {}
        return cls(adapters={k: list(v) for k, v in (value.get("adapters") or {}).items()},
                   engine_seconds=float(value.get("engine_seconds") or 0.0))

    def copy(self) -> ShardUsage:
        return ShardUsage.from_json(self.as_json())


@dataclass
class Progress:
    completed: int = 0
    failed: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0  # of input_tokens, those served from the engine's prefix cache
    cacheable_tokens: int = 0  # of input_tokens, the most a prefix cache could serve
    reasoning_tokens: int = 0  # of output_tokens, those spent reasoning
    # Of completed and failed, the requests the engine ran (Shard.ran_ok); 0 in checkpoints
    # written before they were counted.
    ran_ok: int = 0
    ran_failed: int = 0

    def as_fields(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in SHARD_PROGRESS_FIELDS}


# The kinds of part a shard attempt writes, in the order of a checkpoint segment's names.
PART_KINDS = ("output", "error", "flags")


@dataclass
class Checkpoint:
    """The results an attempt saved so far: its part files' stored segments, in order
    (each an (output, error, flags) triple of storage names, "" for nothing new), the input
    lines they answer, and the counters they carry."""

    attempt: int = 0
    segments: list[tuple[str, str, str]] = field(default_factory=list)
    lines: set[int] = field(default_factory=set)
    progress: Progress = field(default_factory=Progress)
    flag_counts: dict[str, int] = field(default_factory=dict)
    json_retries: int = 0
    usage: ShardUsage = field(default_factory=ShardUsage)

    def as_json(self) -> dict[str, Any]:
        return {"attempt": self.attempt, "segments": [list(s) for s in self.segments],
                "lines": _ranges(self.lines), "progress": self.progress.as_fields(),
                "flag_counts": self.flag_counts, "json_retries": self.json_retries,
                "usage": self.usage.as_json()}

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> Checkpoint:
        if not value:
            return cls()
        return cls(attempt=value["attempt"],
                   segments=[(out, err, flags) for out, err, flags in value["segments"]],
                   lines={line for first, last in value["lines"]
                          for line in range(first, last + 1)},
                   progress=Progress(**value["progress"]),
                   flag_counts=dict(value["flag_counts"]), json_retries=value["json_retries"],
                   usage=ShardUsage.from_json(value.get("usage")))

    def names_of(self, kind: str) -> list[str]:
        """The stored segments of one kind of part (PART_KINDS), in order."""
        index = PART_KINDS.index(kind)
        return [segment[index] for segment in self.segments if segment[index]]

    def storage_names(self) -> list[str]:
        return [name for segment in self.segments for name in segment if name]


def _ranges(lines: set[int]) -> list[list[int]]:
    # Results finish roughly in line order: a shard's lines fold into a few [first, last].
    ranges: list[list[int]] = []
    for line in sorted(lines):
        if ranges and ranges[-1][1] == line - 1:
            ranges[-1][1] = line
        else:
            ranges.append([line, line])
    return ranges
