"""Rerun what did not succeed: a new batch from exactly the input lines of an ended batch's
failed, expired or cancelled requests (the dashboard's buttons, and `POST .../rerun` on both
API faces).

A request that did not succeed has one line in the batch's error file, and its kind is the
line's code: `batch_expired` (its window closed before it ran), `batch_cancelled` (the batch
was cancelled before it ran), anything else failed (the engine's error, a refused body, a
shard that failed). Expired and cancelled requests never ran; a failed one ran or was
refused. "both" is failed and expired, what a user asks for after a batch ran out of time:
cancelled requests are rerun only when asked for by name, since the owner chose to stop
them. The new batch goes through `create_batch` like any other (quotas, the monthly budget
on its own cost ceiling), so it is charged only for what it holds and runs.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from django.db import transaction

from jobs.formats.result_lines import failed_custom_ids, iter_input_matches
from jobs.formats.wire import Code
from jobs.lib.errors import ServiceError, wrong_state
from jobs.models import Batch, File
from jobs.services.batches import MAX_METADATA_PAIRS, create_batch
from jobs.services.files import create_input_file, delete_file
from jobs.storage.external import ObjectChanged
from jobs.storage.objects import open_file
from jobs.storage.temp import local_temp

FAILED = "failed"
EXPIRED = "expired"
CANCELLED = "cancelled"
KINDS = (FAILED, EXPIRED, CANCELLED)
_STOPPED = {Code.BATCH_EXPIRED: EXPIRED, Code.BATCH_CANCELLED: CANCELLED}

# What each API face calls the kinds (Anthropic's are its result types), with "both".
NAMES: dict[str, dict[str, tuple[str, ...]]] = {
    Batch.Api.OPENAI: {"failed": (FAILED,), "expired": (EXPIRED,),
                       "cancelled": (CANCELLED,), "both": (FAILED, EXPIRED)},
    Batch.Api.ANTHROPIC: {"errored": (FAILED,), "expired": (EXPIRED,),
                          "canceled": (CANCELLED,), "both": (FAILED, EXPIRED)},
}


def kind_of(code: str | None) -> str:
    """The kind of request an error line with this code stands for."""
    return _STOPPED.get(code or "", FAILED)


def parse_requests(value: Any, *, api: str) -> frozenset[str]:
    """The kinds a rerun body's `requests` asks for, in the words of its API face: one name,
    or a list of them; failed when left out."""
    names = NAMES[api]
    if value is None:
        return frozenset({FAILED})
    values = value if isinstance(value, list) else [value]
    if not values or not all(isinstance(v, str) and v in names for v in values):
        raise ServiceError(f"requests must be one of {', '.join(map(repr, names))}, or a "
                           "list of them.", param="requests")
    return frozenset(kind for v in values for kind in names[v])


def _words(kinds: Collection[str], api: str) -> str:
    said = {kind: name for name, (kind, *more) in NAMES[api].items() if not more}
    return " or ".join(said[kind] for kind in KINDS if kind in kinds)


def rerun_requests(*, batch: Batch, owner: Any, kinds: Collection[str] = (FAILED,),
                   api_key: Any = None) -> Batch:
    """Create a batch of the requests of an ended batch of the given kinds, with its API,
    endpoint, window, priority, strictness, output lifetime and metadata (plus `rerun_of`
    when there is room: metadata holds at most 16 pairs). The new input file holds the
    original lines byte for byte, in their original order. The eval set is not attached
    again: a rerun of a few requests says little about the model. Nothing is left behind
    when the batch is refused (a quota, the budget)."""
    if not batch.is_ended:
        raise wrong_state(f"Wait until the batch has ended to rerun its requests; it is "
                          f"{batch.status}.")
    wanted = failed_custom_ids(batch, which=lambda code: kind_of(code) in kinds)
    if not wanted:
        raise ServiceError(f"This batch has no {_words(kinds, batch.api)} requests to rerun.",
                           code="nothing_to_rerun")
    source = File.objects.filter(pk=batch.input_file_id, owner=owner).first()
    if source is None:
        raise ServiceError("The input file of this batch was deleted; it cannot be rerun.",
                           code="input_file_deleted", param="input_file_id")
    written = 0
    with local_temp(".rerun") as path:
        try:
            with open(path, "wb") as target, open_file(source) as stream:
                for _custom_id, raw in iter_input_matches(stream, wanted.__contains__):
                    target.write(raw + b"\n")
                    written += 1
        except ObjectChanged:  # an object named in place, replaced since (data by reference)
            raise ServiceError(f"The input object {source.source} changed since the batch "
                               "read it; register it again and create a batch of it.",
                               code="input_changed", param="input_file_id") from None
        if not written:  # their lines are not in the input any more (replaced by hand)
            raise ServiceError(f"This batch has no {_words(kinds, batch.api)} requests to "
                               "rerun.", code="nothing_to_rerun")
        label = "_".join(kind for kind in KINDS if kind in kinds)
        # A Message Batch's lines were held to its API's own limits when it was created:
        # some of them are within those limits still.
        file = create_input_file(owner=owner, path=path, filename=f"{batch.pk}_{label}.jsonl",
                                 purpose=File.Purpose.BATCH,
                                 limits_checked=batch.api == Batch.Api.ANTHROPIC)
    metadata = dict(batch.metadata or {})
    if "rerun_of" in metadata or len(metadata) < MAX_METADATA_PAIRS:
        metadata["rerun_of"] = batch.pk
    lifetime = batch.output_expires_after
    try:
        with transaction.atomic():
            new = create_batch(
                owner=owner, input_file_id=file.pk, endpoint=batch.endpoint,
                completion_window=batch.completion_window, metadata=metadata,
                priority=batch.priority, strict=batch.strict, api=batch.api, api_key=api_key,
                output_expires_after=({"anchor": "created_at", "seconds": lifetime}
                                      if lifetime else None))
            if batch.api == Batch.Api.ANTHROPIC:
                # Anthropic counts every request as processing from the start (as a Message
                # Batch created from a body does).
                Batch.objects.filter(pk=new.pk).update(total=written)
    except ServiceError:
        delete_file(file=file)
        raise
    return Batch.objects.get(pk=new.pk)


def reruns_of(batch: Batch) -> list[Batch]:
    """The batches created as reruns of `batch`, oldest first (they are younger than it:
    the owner's batches since it was created are the only ones read)."""
    return list(Batch.objects.filter(owner_id=batch.owner_id, created_at__gte=batch.created_at,
                                     metadata__rerun_of=batch.pk)
                .exclude(pk=batch.pk).order_by("created_at", "pk")[:50])
