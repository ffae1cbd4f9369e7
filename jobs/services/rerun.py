"""Rerun what did not succeed: a new batch from exactly the input lines of an ended batch's
failed, expired or cancelled requests (the dashboard's buttons, and `POST .../rerun` on both
API faces).

A request that did not succeed has one line in the batch's error file, and its kind is the
line's code: `batch_expired` (its window closed before it ran), `batch_cancelled` (the batch
was cancelled before it ran), failed when the service failed it and it may succeed if sent
again (a server error, a time-out or rate limit, a shard that failed, a request aborted),
and invalid when the request itself was refused (a 4xx such as a body the endpoint refused
or a prompt over the context, a content rule, an adapter since removed): sent again as it
is, it fails again. By default a rerun takes every request that may succeed on a second
try (failed, expired, cancelled) and counts the invalid ones it left out (`rerun_left_out`
in the new batch's metadata); the user fixes those lines (`lines_to_fix`, the dashboard's
download) or asks for them by name ("invalid"). "both" is failed and expired, what a user
asks for after a batch ran out of time. The new batch goes through `create_batch` like any
other (quotas, the monthly budget on its own cost ceiling), so it is charged only for what
it holds and runs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterator
from typing import Any

from django.db import transaction

from jobs.formats.result_lines import failed_custom_ids, iter_input_matches
from jobs.formats.wire import Code
from jobs.lib import heavy
from jobs.lib.errors import ServiceError, wrong_state
from jobs.models import Batch, File
from jobs.services.batches import MAX_METADATA_PAIRS, create_batch
from jobs.services.files import create_input_file, delete_file
from jobs.services.grants import check_source_readable
from jobs.storage.external import ObjectChanged
from jobs.storage.objects import open_file
from jobs.storage.temp import local_temp

FAILED = "failed"
EXPIRED = "expired"
CANCELLED = "cancelled"
INVALID = "invalid"
KINDS = (FAILED, EXPIRED, CANCELLED, INVALID)
# What a rerun takes when the user names nothing: what may succeed on a second try.
RETRYABLE = frozenset({FAILED, EXPIRED, CANCELLED})
_STOPPED = {Code.BATCH_EXPIRED: EXPIRED, Code.BATCH_CANCELLED: CANCELLED}
# Codes of requests the service failed without any fault of theirs (error lines without an
# HTTP answer); an HTTP answer is the service's when it is a 5xx, a time-out or 429.
_SERVICE_FAILED = frozenset({Code.SHARD_FAILED, Code.REQUEST_ABORTED, Code.INPUT_CHANGED})
_RETRYABLE_STATUS = frozenset({408, 429})
# Where the metadata of a rerun counts the invalid requests it left out.
LEFT_OUT = "rerun_left_out"

# What each API face calls the kinds (Anthropic's are its result types), with "both".
NAMES: dict[str, dict[str, tuple[str, ...]]] = {
    Batch.Api.OPENAI: {"failed": (FAILED,), "expired": (EXPIRED,),
                       "cancelled": (CANCELLED,), "invalid": (INVALID,),
                       "both": (FAILED, EXPIRED)},
    Batch.Api.ANTHROPIC: {"errored": (FAILED,), "expired": (EXPIRED,),
                          "canceled": (CANCELLED,), "invalid": (INVALID,),
                          "both": (FAILED, EXPIRED)},
}


def kind_of(code: str | None) -> str:
    """The kind of request an error line with this code stands for."""
    if code in _STOPPED:
        return _STOPPED[code]
    if code in _SERVICE_FAILED:
        return FAILED
    status = code[5:] if code and code.startswith("http_") else ""
    if status.isdigit() and (int(status) >= 500 or int(status) in _RETRYABLE_STATUS):
        return FAILED
    return INVALID


def parse_requests(value: Any, *, api: str) -> frozenset[str]:
    """The kinds a rerun body's `requests` asks for, in the words of its API face: one name,
    or a list of them; every kind that may succeed on a second try when left out."""
    names = NAMES[api]
    if value is None:
        return RETRYABLE
    values = value if isinstance(value, list) else [value]
    if not values or not all(isinstance(v, str) and v in names for v in values):
        raise ServiceError(f"requests must be one of {', '.join(map(repr, names))}, or a "
                           "list of them.", param="requests")
    return frozenset(kind for v in values for kind in names[v])


def _words(kinds: Collection[str], api: str) -> str:
    said = {kind: name for name, (kind, *more) in NAMES[api].items() if not more}
    names = [said[kind] for kind in KINDS if kind in kinds]
    return " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 2 else names)


def rerun_requests(*, batch: Batch, owner: Any, kinds: Collection[str] = RETRYABLE,
                   api_key: Any = None) -> Batch:
    """Create a batch of the requests of an ended batch of the given kinds, with its API,
    endpoint, window, priority, strictness, output lifetime and metadata (plus `rerun_of`,
    and `rerun_left_out` when failed requests were asked for and invalid ones were not,
    when there is room: metadata holds at most 16 pairs). The new input file holds the
    original lines byte for byte, in their original order. The eval set is not attached
    again: a rerun of a few requests says little about the model. Nothing is left behind
    when the batch is refused (a quota, the budget)."""
    if not batch.is_ended:
        raise wrong_state(f"Wait until the batch has ended to rerun its requests; it is "
                          f"{batch.status}.")
    seen: Counter[str] = Counter()

    def which(code: str | None) -> bool:
        seen[kind_of(code)] += 1
        return kind_of(code) in kinds

    wanted = failed_custom_ids(batch, which=which)
    left_out = seen[INVALID] if FAILED in kinds and INVALID not in kinds else 0
    if not wanted:
        raise _nothing_to_rerun(kinds, batch.api, left_out)
    source = File.objects.filter(pk=batch.input_file_id, owner=owner).first()
    if source is None:
        raise ServiceError("The input file of this batch was deleted; it cannot be rerun.",
                           code="input_file_deleted", param="input_file_id")
    check_source_readable(file=source, param="input_file_id")
    written = 0
    # The copy is a pass over the input and a check of the new file: one of a user's at a
    # time. Let go before create_batch, whose own check takes the same guard.
    with heavy.one_per_user_or_refuse(owner.pk, doing="rerunning a batch"), \
            local_temp(".rerun") as path:
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
    metadata.pop(LEFT_OUT, None)  # a rerun of a rerun says what it left out itself
    if "rerun_of" in metadata or len(metadata) < MAX_METADATA_PAIRS:
        metadata["rerun_of"] = batch.pk
    if left_out and len(metadata) < MAX_METADATA_PAIRS:
        metadata[LEFT_OUT] = str(left_out)  # metadata values are strings
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


def left_out_of(batch: Batch) -> int:
    """How many invalid requests of its original a rerun left out (its metadata's
    `rerun_left_out`, as written here; any other value is the user's own: 0)."""
    value = (batch.metadata or {}).get(LEFT_OUT)
    return int(value) if isinstance(value, str) and value.isdigit() and len(value) < 10 else 0


def _nothing_to_rerun(kinds: Collection[str], api: str, left_out: int) -> ServiceError:
    if left_out:
        return ServiceError(
            f"This batch has no {_words(kinds, api)} requests that may succeed if sent again: "
            f"its {left_out} {_words({FAILED}, api)} request{'s' if left_out != 1 else ''} "
            f"{'were' if left_out != 1 else 'was'} refused as invalid and would fail the same "
            "way. Fix their lines (the batch page offers them as a download) and create a new "
            "batch, or ask for requests 'invalid' to rerun them as they are.",
            code="nothing_to_rerun")
    return ServiceError(f"This batch has no {_words(kinds, api)} requests to rerun.",
                        code="nothing_to_rerun")


def lines_to_fix(*, batch: Batch, owner: Any) -> Iterator[bytes]:
    """The input lines, byte for byte and in their order, of the batch's invalid requests:
    what its owner fixes before running them again (the dashboard's download). Nothing when
    the batch has none or its input file is gone."""
    wanted = failed_custom_ids(batch, which=lambda code: kind_of(code) == INVALID)
    source = File.objects.filter(pk=batch.input_file_id, owner=owner).first()
    if not wanted or source is None:
        return iter(())
    check_source_readable(file=source, param="input_file_id")
    return _lines_of(source, wanted)


def _lines_of(source: File, wanted: set[str]) -> Iterator[bytes]:
    with open_file(source) as stream:
        for _custom_id, raw in iter_input_matches(stream, wanted.__contains__):
            yield raw + b"\n"


def reruns_of(batch: Batch) -> list[Batch]:
    """The batches created as reruns of `batch`, oldest first (they are younger than it:
    the owner's batches since it was created are the only ones read)."""
    return list(Batch.objects.filter(owner_id=batch.owner_id, created_at__gte=batch.created_at,
                                     metadata__rerun_of=batch.pk)
                .exclude(pk=batch.pk).order_by("created_at", "pk")[:50])
