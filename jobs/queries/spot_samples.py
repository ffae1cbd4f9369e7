"""What the spot-check tab shows: a random sample of a batch's results (of all its
finished requests, or of its flagged ones only), the verdicts marked on it, and the share
marked good. Marking is `jobs.services.spotcheck`."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

from django.db.models import Count, Q

from jobs.formats.result_lines import Segment, parse_result_line, scan, segments
from jobs.lib.compiled import Compiled
from jobs.lib.heavy import Guard, cached, version
from jobs.models import Batch, SpotCheck
from jobs.queries.flags import FlagRow, find_outputs, flag_labels, flag_segments, iter_flagged
from jobs.queries.results import PREVIEW_LINE_BYTES

SPOT_SHARE = 0.05
SPOT_MIN = 10
SPOT_MAX = 200


def spot_sample_size(finished: int) -> int:
    """5% of the finished requests, at least 10 and at most 200 (never more than exist)."""
    return min(finished, max(SPOT_MIN, min(SPOT_MAX, math.ceil(finished * SPOT_SHARE))))


@dataclass
class SampleItem:
    custom_id: str
    body: Any  # the response body (clipped when huge)
    flags: tuple[str, ...] = ()  # quality flags (the flagged-only sample)

    @property
    def flag_labels(self) -> list[tuple[str, str]]:
        return flag_labels(self.flags)


def spot_sample(batch: Batch, *, guard: Guard | None = None) -> list[SampleItem]:
    """A random sample of the batch's successful results, drawn in one pass (reservoir
    sampling) with the batch id as seed, so the same batch shows the same sample. Cached
    by progress: the key names the result parts read and the count the size comes from,
    so a finished shard gives a new sample and repeated views of the same one are a cache
    read (`guard` is entered only to compute)."""
    segs = segments(batch, "output")
    finished = batch.progress()["completed"]
    key = f"spot:{batch.pk}:{version(finished, segs)}"
    return cached(key, lambda: _spot_sample(batch, segs, finished), guard=guard)


def _spot_sample(batch: Batch, segs: list[Segment], finished: int) -> list[SampleItem]:
    k = spot_sample_size(finished)
    if k == 0:
        return []
    rng = random.Random(batch.pk)
    reservoir: list[tuple[str, bytes | None, int]] = []
    for seen, (here, content, length) in enumerate(
            scan(segs, None, max_line_bytes=PREVIEW_LINE_BYTES), start=1):
        if len(reservoir) < k:
            reservoir.append((here, content, length))
        else:
            j = rng.randrange(seen)
            if j < k:
                reservoir[j] = (here, content, length)
    items = []
    for here, content, length in sorted(reservoir):
        row = parse_result_line(here, content, length)
        if row.custom_id is not None:
            items.append(SampleItem(row.custom_id, row.body))
    return items


def flagged_sample(batch: Batch, *, guard: Guard | None = None) -> list[SampleItem]:
    """The spot-check sample drawn among flagged requests only: same rules as spot_sample
    (5% of them, at least 10, at most 200; reservoir sampling seeded by the batch id;
    cached by progress), over the flags parts, then their output lines (the shards' parts
    while the batch runs, its output file once it ended)."""
    segs = flag_segments(batch)
    key = f"spotflag:{batch.pk}:{version(batch.is_ended, batch.output_file_id, segs)}"
    return cached(key, lambda: _flagged_sample(batch, segs), guard=guard)


def _flagged_sample(batch: Batch, segs: list[Segment]) -> list[SampleItem]:
    rng = random.Random(batch.pk)
    reservoir: list[FlagRow] = []
    seen = 0
    for row in iter_flagged(batch, segs=segs):
        seen += 1
        if len(reservoir) < SPOT_MAX:
            reservoir.append(row)
        else:
            j = rng.randrange(seen)
            if j < SPOT_MAX:
                reservoir[j] = row
    k = spot_sample_size(seen)
    # The reservoir holds SPOT_MAX uniformly drawn rows; a uniform subset of it is a
    # uniform sample of k.
    chosen = sorted(rng.sample(reservoir, k) if k < len(reservoir) else reservoir,
                    key=lambda r: (r.shard_index, int(r.cursor.partition(":")[2])))
    outputs = find_outputs(batch, chosen)
    return [SampleItem(r.custom_id, outputs[r.custom_id].body, tuple(r.flags)) for r in chosen
            if r.custom_id in outputs]


def sample(batch: Batch, *, flagged: bool = False,
           guard: Guard | None = None) -> list[SampleItem]:
    """The spot-check sample: of all finished requests, or of the flagged ones only."""
    return (flagged_sample(batch, guard=guard) if flagged
            else spot_sample(batch, guard=guard))


@dataclass
class SpotSummary:
    marked: int
    good: int

    @property
    def share_good(self) -> float | None:
        return self.good / self.marked if self.marked else None


# Read on every poll of the batch page's live block: compiled once. One row (the counts)
# when the batch has marks, none when it has not.
_SUMMARY = Compiled(lambda batch_id: SpotCheck.objects.filter(batch_id=batch_id).order_by()
                    .values("batch_id").annotate(
                        marked=Count("pk"),
                        good=Count("pk", filter=Q(verdict=SpotCheck.Verdict.GOOD)))
                    .values_list("marked", "good"), "batch_id")


def summary(batch: Batch) -> SpotSummary:
    for marked, good in _SUMMARY.rows(batch_id=batch.pk):
        return SpotSummary(marked=marked, good=good)
    return SpotSummary(marked=0, good=0)


def marks(batch: Batch) -> dict[str, SpotCheck]:
    return {m.custom_id: m for m in SpotCheck.objects.filter(batch=batch)}
