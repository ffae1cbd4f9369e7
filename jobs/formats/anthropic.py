"""Anthropic's Message Batches API shapes, translated from ours in one place: the
MessageBatch object and its request counts, and the result lines.

What a Message Batch is here (anthropic/types/messages/message_batch.py):
    processing_status: validating, in_progress, finalizing -> "in_progress";
                       cancelling -> "canceling"; completed, failed, expired,
                       cancelled -> "ended"
    request_counts:    every request "processing" until the batch ends (as Anthropic's);
                       then succeeded (output lines), canceled (batch_cancelled lines),
                       expired (batch_expired lines), errored (every other error line)
    ended_at:          completed_at, cancelled_at, expired_at or failed_at
    cancel_initiated_at: cancelling_at; expires_at the 24-hour window
    archived_at:       set once retention removed its results (MESSAGE_BATCH_RESULTS_DAYS
                       after it ended): its results then answer 404 not_found_error, and
                       its request counts are those kept when it was archived
    results_url:       .../v1/messages/batches/{id}/results once ended, else null
A result line (MessageBatchIndividualResponse), from an output or error line:
    output line (200)               -> {"type": "succeeded", "message": <Message>}
    error line batch_cancelled      -> {"type": "canceled"}
    error line batch_expired        -> {"type": "expired"}
    HTTP error from the engine      -> {"type": "errored", "error": <its Anthropic error>}
    shard_failed, request_aborted   -> errored, api_error
    any other code (a refused request, a content rule)
                                    -> errored, invalid_request_error
A batch that failed validation ran nothing: each request is `errored` with the problem of
its line (or, for the others, with the batch's first problem).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

from django.conf import settings

from engine.endpoints import anthropic_error
from jobs.formats.result_lines import Kind, error_counts, segments
from jobs.formats.wire import Code, LineError, custom_id_of, read_result_line
from jobs.lib.errors import ServiceError
from jobs.lib.heavy import Guard
from jobs.models import Batch, File
from jobs.storage.lines import iter_lines
from jobs.storage.objects import open_file, open_range

# A result line is read whole however long (a Message of a long answer).
_MAX_RESULT_LINE = 256 * 1024 * 1024
# Errors of the service itself (the request may succeed if sent again), not of the request.
_SERVER_CODES = frozenset({Code.SHARD_FAILED, Code.REQUEST_ABORTED})

PROCESSING_STATUS = {
    Batch.Status.VALIDATING: "in_progress",
    Batch.Status.IN_PROGRESS: "in_progress",
    Batch.Status.FINALIZING: "in_progress",
    Batch.Status.CANCELLING: "canceling",
    Batch.Status.COMPLETED: "ended",
    Batch.Status.FAILED: "ended",
    Batch.Status.EXPIRED: "ended",
    Batch.Status.CANCELLED: "ended",
}


# A field path the endpoints write from an OpenAI batch line's `body` ("body.temperature",
# "body.messages[0]"), or a quoted value the user sent, which is left as it is.
_BODY_PATH = re.compile(r"'[^']*'|\bbody(?=\.[A-Za-z_]|\[|$)")


def params_named(error: LineError) -> LineError:
    """A Message Batch request's problem as its user wrote the request: `params`, not the
    `body` of the batch line it became (`params.temperature must be between 0 and 1`)."""
    def rename(text: str) -> str:
        return _BODY_PATH.sub(lambda m: "params" if m.group(0) == "body" else m.group(0), text)

    return LineError(error.code, rename(error.message),
                     rename(error.param) if error.param else error.param)


def rfc3339(value: datetime | None) -> str | None:
    if value is None:
        return None
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")


def request_counts(batch: Batch, *, guard: Guard | None = None) -> dict[str, int]:
    """Anthropic's tallies: all processing until the batch ends, then by outcome. The
    cancelled and expired requests of a stopped batch are counted in its error file (one
    pass, cached, see jobs.formats.result_lines.error_counts; under `guard` when it counts)."""
    counts = {"processing": 0, "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0}
    if batch.archived_counts:  # its error file is gone: as counted when it was archived
        return {**counts, **batch.archived_counts}
    if not batch.is_ended:
        counts["processing"] = batch.total
        return counts
    if batch.status == Batch.Status.FAILED:
        counts["errored"] = batch.total
        return counts
    counts["succeeded"] = batch.completed
    if batch.stop_code:
        by_code = dict(error_counts(batch, guard=guard))
        counts["canceled"] = by_code.get(Code.BATCH_CANCELLED, 0)
        counts["expired"] = by_code.get(Code.BATCH_EXPIRED, 0)
    counts["errored"] = max(0, batch.failed - counts["canceled"] - counts["expired"])
    return counts


def message_batch(batch: Batch, *, base_url: str, guard: Guard | None = None
                  ) -> dict[str, Any]:
    """The MessageBatch object; `base_url` is the service's own (results_url is absolute,
    as Anthropic's, and the client fetches it as it is). `guard`: see request_counts."""
    return {
        "id": batch.id,
        "type": "message_batch",
        "processing_status": PROCESSING_STATUS[Batch.Status(batch.status)],
        "request_counts": request_counts(batch, guard=guard),
        "ended_at": rfc3339(batch.ended_at),
        "created_at": rfc3339(batch.created_at),
        "expires_at": rfc3339(batch.expires_at),
        "archived_at": rfc3339(batch.archived_at),
        "cancel_initiated_at": rfc3339(batch.cancelling_at),
        "results_url": (f"{base_url.rstrip('/')}/v1/messages/batches/{batch.id}/results"
                        if batch.is_ended else None),
        # Extensions, as on the OpenAI face: what ran it (without the machines' names),
        # its eval runs and drift.
        **batch.extension_fields(),
    }


def check_results_kept(batch: Batch) -> None:
    """Refuse the results of an archived batch as Anthropic does: they are gone (404)."""
    if batch.archived_at is not None:
        raise ServiceError(f"The results of {batch.id} are no longer available: they "
                           f"expired, and the batch was archived at "
                           f"{rfc3339(batch.archived_at)}.", status=404, code="not_found")


def _line(custom_id: str, result: dict[str, Any]) -> bytes:
    return json.dumps({"custom_id": custom_id, "result": result},
                      ensure_ascii=False).encode() + b"\n"


def result_line(content: bytes) -> bytes | None:
    """The Anthropic result line of one of our output or error lines (see the module
    docstring); None for a line that names no request (changed by hand, cut short)."""
    line = read_result_line(content)
    if line.custom_id is None:
        return None
    if line.code is None:
        return _line(line.custom_id, {"type": "succeeded", "message": line.body})
    if line.code == Code.BATCH_CANCELLED:
        return _line(line.custom_id, {"type": "canceled"})
    if line.code == Code.BATCH_EXPIRED:
        return _line(line.custom_id, {"type": "expired"})
    if line.status_code is not None:  # the engine's HTTP error
        body = line.body
        error = body if isinstance(body, dict) and body.get("type") == "error" else \
            anthropic_error(line.status_code, line.message or f"HTTP {line.status_code}")
    else:
        error = anthropic_error(500 if line.code in _SERVER_CODES else 400, line.message)
    return _line(line.custom_id, {"type": "errored", "error": error})


def results(batch: Batch) -> Iterator[bytes]:
    """Every request's result line, once the batch has ended: its output file, then its
    error file (Anthropic promises no order: results are matched by custom_id)."""
    if batch.status == Batch.Status.FAILED:
        yield from _unvalidated(batch)
        return
    kinds: tuple[Kind, ...] = ("output", "error")
    for kind in kinds:
        for segment in segments(batch, kind):
            with open_range(segment.storage_name, 0) as stream:
                for line in iter_lines(stream, max_line_bytes=_MAX_RESULT_LINE):
                    if line.content and (translated := result_line(line.content)):
                        yield translated


def _unvalidated(batch: Batch) -> Iterator[bytes]:
    """The results of a batch that failed validation, from its input file: each request
    errored with its line's problem (errors.data), or the batch's first one."""
    problems = {entry.get("line"): entry.get("message") for entry in batch.errors}
    first = next(iter(problems.values()), "the batch could not be validated")
    file = File.objects.filter(pk=batch.input_file_id).first()
    if file is None:
        return
    with open_file(file) as stream:
        for line in iter_lines(stream, max_line_bytes=settings.BATCHWEB["MAX_LINE_BYTES"]):
            custom_id = custom_id_of(line.content)
            if custom_id is None:
                continue
            message = problems.get(line.number) or (
                f"Not run: the batch failed validation ({first})")
            yield _line(custom_id, {"type": "errored",
                                    "error": anthropic_error(400, message)})
