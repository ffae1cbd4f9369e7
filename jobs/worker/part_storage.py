"""A shard's parts in storage, in one place: each checkpoint's segment (what the parts got
since the last one), the finished attempt's parts (its segments joined inside the storage,
server-side copies on S3, with the last unsaved bytes), and the deletion of what is no
longer wanted. The
storage is shared: any machine's worker can adopt another's segments."""

from __future__ import annotations

import logging

from django.core.files.base import ContentFile
from django.core.files.storage import default_storage

from jobs.formats.checkpoint_record import PART_KINDS
from jobs.storage.backends import Source, backend
from jobs.worker.work import ShardWork

log = logging.getLogger(__name__)


def store_segment(work: ShardWork, start: tuple[int, int, int],
                  end: tuple[int, int, int]) -> tuple[str, str, str]:
    """Save what each part got between two offsets (whole lines) as the next checkpoint
    segment; "" for a kind with nothing new."""
    names = []
    number = len(work.saved.segments)
    for part, kind, first, last in zip(work.parts(), PART_KINDS, start, end, strict=True):
        if last <= first:
            names.append("")
            continue
        names.append(default_storage.save(
            f"parts/{work.batch_id}/{work.shard_id}-{work.attempt}.ckpt{number}.{kind}.jsonl",
            ContentFile(part.between(first, last))))
    return names[0], names[1], names[2]


def store_parts(work: ShardWork, stored: list[str]) -> None:
    """Save the finished attempt's parts, each its checkpoint segments joined inside the
    storage with the bytes written since, appending each storage name ("" for an empty part)
    to `stored` as it goes, so the caller can delete what was saved if a later step fails.
    Called once the results have stopped coming in."""
    storage = backend()
    for index, (part, kind) in enumerate(zip(work.parts(), PART_KINDS, strict=True)):
        sources: list[Source] = [segment[index] for segment in work.saved.segments
                                 if segment[index]]
        rest = part.between(part.saved, part.tell())
        if rest:
            sources.append([rest])
        name = f"parts/{work.batch_id}/{work.shard_id}-{work.attempt}.{kind}.jsonl"
        stored.append(name if sources and storage.concatenate(name, sources) else "")


def delete_stored(names: list[str]) -> None:
    for name in names:
        if name:
            try:
                default_storage.delete(name)
            except Exception:
                log.exception("could not delete %s", name)
