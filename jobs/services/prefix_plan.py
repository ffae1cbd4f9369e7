"""Prefix planning: whether a batch's shards run its lines grouped by prompt prefix, and if
so, which lines each shard runs.

Validation hands every line that runs (`add`) with its prefix key
(jobs.formats.prefix_keys). At the end (`finish`) the file's own statistics decide:

- grouped, every request after the first of its group can find the shared prefix in the
  engine's prefix cache;
- in file order, a request finds it only if the previous request with its key ran
  recently enough for the prefix to still be cached: within the last W requests, where W
  is the cache (what the model's workers report, or PREFIX_CACHE_TOKENS: see
  jobs.services.validation.planning_cache_tokens) over the mean prompt size;
- the prompt tokens grouping would serve from the cache beyond what file order already
  does, as a share of all prompt tokens, must reach PREFIX_MIN_GAIN, or the file keeps its
  order (and today's byte-range shards: nothing changes for a file without groups).

A grouped plan orders the lines by group (groups in the order of their first line, lines
of a group in file order, lines without a key where they fall) and cuts shards of at most
SHARD_SIZE lines, starting a new shard rather than splitting a group that fits in one.
Shards of one group are neighbours, so the scheduler hands them out back to back.

Memory: 24 bytes per line in numpy arrays (a million lines: 24 MB), whatever the keys.
"""

from __future__ import annotations

from array import array
from dataclasses import asdict, dataclass

import numpy as np

from jobs.formats.prefix_keys import PrefixKey
from jobs.storage.line_index import RECORD
from jobs.storage.lines import Line


@dataclass
class PrefixPlan:
    """What planning found and decided; stored as Batch.plan and shown on the batch page."""

    grouped: bool = False
    groups: int = 0  # prefix groups of two or more requests
    keyed: int = 0  # requests with a prefix key
    prefix_tokens: int = 0  # estimated prompt tokens grouping serves from the cache
    hits_file_order: float = 0.0  # share of keyed requests expected to hit, in file order
    hits_grouped: float = 0.0  # the same, grouped
    cache_tokens: int = 0  # the engine's prefix cache planned for, in tokens
    reason: str = ""

    def to_json(self) -> dict[str, object]:
        return asdict(self)


@dataclass
class GroupedShard:
    index: int
    lines_from: int  # records [lines_from, lines_to) of the line index
    lines_to: int
    first_line: int  # its smallest line number
    lines: int = 0
    responsible: int = 0  # its lines plus the dedup copies of its primaries


class PrefixPlanner:
    def __init__(self, *, shard_size: int, cache_tokens: int, min_gain: float,
                 enabled: bool = True) -> None:
        self.shard_size = shard_size
        self.cache_tokens = cache_tokens
        self.min_gain = min_gain
        self.enabled = enabled
        # Per line that runs, in file order.
        self.keys = array("Q")  # 0: no key
        self.prefix_chars = array("I")
        self.starts = array("Q")
        self.lengths = array("I")
        self.numbers = array("I")
        self.prompt_tokens = 0
        # Primary line of every dedup copy (its copies follow the primary's shard).
        self.copy_primaries = array("I")

    def add(self, line: Line, key: PrefixKey | None, prompt_tokens: int) -> None:
        self.keys.append((key.digest or 1) if key else 0)  # 0 is "no key"
        self.prefix_chars.append(key.chars if key else 0)
        self.starts.append(line.start)
        self.lengths.append(line.end - line.start)
        self.numbers.append(line.number)
        self.prompt_tokens += prompt_tokens

    def add_copy(self, primary_line: int) -> None:
        self.copy_primaries.append(primary_line)

    def finish(self) -> tuple[PrefixPlan, np.ndarray | None, list[GroupedShard]]:
        """The plan; when grouped, the line index records in run order and the shards."""
        plan = PrefixPlan(cache_tokens=self.cache_tokens)
        keys = np.frombuffer(self.keys, dtype=np.uint64)
        keyed = keys != 0
        plan.keyed = int(keyed.sum())
        if not self.enabled:
            plan.reason = "Prefix grouping is turned off."
            return plan, None, []
        if plan.keyed < 2:
            plan.reason = "No requests share a long prompt prefix."
            return plan, None, []

        positions = np.flatnonzero(keyed)
        order = positions[np.argsort(keys[positions], kind="stable")]
        sorted_keys = keys[order]
        same_as_previous = np.zeros(len(order), dtype=bool)
        same_as_previous[1:] = sorted_keys[1:] == sorted_keys[:-1]
        group_starts = ~same_as_previous
        sizes = np.diff(np.append(np.flatnonzero(group_starts), len(order)))
        plan.groups = int((sizes >= 2).sum())
        repeats = same_as_previous  # in a group, every request after the first
        if not repeats.any():
            plan.reason = "No two requests share a long prompt prefix."
            return plan, None, []

        # File order: a repeat hits if its previous request with the key is within the
        # last `window` requests.
        mean_tokens = max(1.0, self.prompt_tokens / max(1, len(keys)))
        window = max(1, int(self.cache_tokens / mean_tokens))
        gaps = np.zeros(len(order), dtype=np.int64)
        gaps[1:] = order[1:].astype(np.int64) - order[:-1].astype(np.int64)
        hits_in_file_order = repeats & (gaps <= window)
        plan.hits_grouped = round(float(repeats.sum()) / plan.keyed, 4)
        plan.hits_file_order = round(float(hits_in_file_order.sum()) / plan.keyed, 4)
        gained = repeats & ~hits_in_file_order
        chars = np.frombuffer(self.prefix_chars, dtype=np.uint32)[order]
        plan.prefix_tokens = int(chars[gained].sum() // 4)
        share = plan.prefix_tokens / max(1, self.prompt_tokens)
        if share < self.min_gain:
            plan.reason = (f"Grouping would serve {share:.0%} more of the prompt tokens from "
                           f"the prefix cache than file order; it pays from "
                           f"{self.min_gain:.0%}.")
            return plan, None, []
        plan.grouped = True
        plan.reason = (f"Grouped: {plan.groups} prefix groups; about {share:.0%} of the "
                       f"prompt tokens served from the prefix cache that file order would "
                       f"compute again.")
        records, leaders = self._records(keys, order, group_starts)
        return plan, records, self._cut(records, leaders)

    def _records(self, keys: np.ndarray, order: np.ndarray,
                 group_starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Every line in run order (groups by their first line, keyless lines in place),
        and the position of each one's group leader."""
        count = len(keys)
        # The position of each line's group leader (its own for a keyless line).
        leader = np.arange(count, dtype=np.int64)
        group_ids = np.cumsum(group_starts) - 1
        first_of_group = np.minimum.reduceat(order, np.flatnonzero(group_starts))
        leader[order] = first_of_group[group_ids]
        run_order = np.lexsort((np.arange(count), leader))
        records = np.empty(count, dtype=RECORD)
        records["start"] = np.frombuffer(self.starts, dtype=np.uint64)[run_order]
        records["length"] = np.frombuffer(self.lengths, dtype=np.uint32)[run_order]
        records["line"] = np.frombuffer(self.numbers, dtype=np.uint32)[run_order]
        return records, leader[run_order]

    def _cut(self, records: np.ndarray, leaders: np.ndarray) -> list[GroupedShard]:
        """Shards of at most shard_size lines; a group that fits in a shard is not split."""
        count = len(records)
        boundaries = np.flatnonzero(np.diff(leaders)) + 1
        group_bounds = np.concatenate(([0], boundaries, [count]))
        shards: list[GroupedShard] = []
        start = 0
        for group_start, group_end in zip(group_bounds[:-1], group_bounds[1:], strict=True):
            held, size = group_start - start, group_end - group_start
            # Close the shard before a group that would overflow it, unless the group is
            # bigger than a shard anyway and the shard is less than half full.
            if held and held + size > self.shard_size and (
                    size <= self.shard_size or held >= self.shard_size // 2):
                shards.append(self._shard(len(shards), start, group_start, records))
                start = group_start
            while group_end - start > self.shard_size:
                shards.append(self._shard(len(shards), start, start + self.shard_size,
                                          records))
                start += self.shard_size
        if start < count:
            shards.append(self._shard(len(shards), start, count, records))
        self._count_copies(shards, records)
        return shards

    @staticmethod
    def _shard(index: int, start: int, end: int, records: np.ndarray) -> GroupedShard:
        return GroupedShard(index=index, lines_from=int(start), lines_to=int(end),
                            first_line=int(records["line"][start:end].min()),
                            lines=int(end - start), responsible=int(end - start))

    def _count_copies(self, shards: list[GroupedShard], records: np.ndarray) -> None:
        """Each dedup copy is answered by its primary's shard."""
        if not len(self.copy_primaries):
            return
        shard_of_record = np.empty(len(records), dtype=np.int64)
        for shard in shards:
            shard_of_record[shard.lines_from:shard.lines_to] = shard.index
        by_line = np.argsort(records["line"])
        primaries = np.frombuffer(self.copy_primaries, dtype=np.uint32)
        found = np.searchsorted(records["line"][by_line], primaries)
        counts = np.bincount(shard_of_record[by_line[found]], minlength=len(shards))
        for shard in shards:
            shard.responsible += int(counts[shard.index])
