"""Anthropic's Message Batches: created as a batch input file and a normal Batch (api
"anthropic", endpoint /v1/messages), so validation, sharding, dedup, quotas, content
rules, workers, cancel, expiry and finalization are the OpenAI batches' own; and deleted
once ended, as Anthropic allows.

The create body, `{"requests": [{"custom_id", "params"}, ...]}`, is read as a stream: each
request becomes one input line as soon as it is parsed, so memory holds one request at a
time however large the batch (up to MESSAGE_BATCH_MAX_BYTES, Anthropic's 256 MB by
default). Reading stops at the request after MESSAGE_BATCH_MAX_REQUESTS (Anthropic's
100,000): a body of millions of tiny requests is refused then, not parsed to its end.

Results are kept MESSAGE_BATCH_RESULTS_DAYS (Anthropic's 29) after the batch ends: its
output and error files expire then, and cleanup archives it (`archive_results`).
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterator
from datetime import datetime
from typing import Any, Protocol

from django.conf import settings
from django.db import transaction
from django.db.models import Q

from engine.endpoints import MESSAGES
from jobs.formats import anthropic
from jobs.formats.wire import raw_decode_strict
from jobs.lib.errors import ServiceError, wrong_state
from jobs.models import Batch, File
from jobs.services.batches import create_batch
from jobs.services.files import create_input_file, delete_file
from jobs.storage.temp import local_temp

# Anthropic's rule for a request's custom_id.
CUSTOM_ID = re.compile(r"[a-zA-Z0-9_-]{1,64}")
# Every Message Batch has Anthropic's 24-hour window.
WINDOW = "24h"
_READ = 64 * 1024
_NOT_WHITESPACE = re.compile(r"[^ \t\n\r]")
_DELIMITER = re.compile(r"[,\]}\s]")


class Readable(Protocol):
    """A body to read from: a file, or the HttpRequest itself (never read whole)."""

    def read(self, size: int, /) -> bytes: ...


def too_large(limit: int) -> ServiceError:
    return ServiceError(f"The request body is larger than {limit} bytes.", status=413,
                        code="request_too_large")


class _JsonStream:
    """JSON values read one at a time from a byte stream: a buffer of text that grows
    only as far as the value being parsed (at most `max_value` characters)."""

    def __init__(self, stream: Readable, *, limit: int, max_value: int) -> None:
        self.stream = stream
        self.limit = limit
        self.max_value = max_value
        self.read_bytes = 0
        self.decoder = codecs.getincrementaldecoder("utf-8")()
        self.text = ""
        self.pos = 0
        self.eof = False

    def _more(self, at_least: int = _READ) -> bool:
        if self.eof:
            return False
        chunk = self.stream.read(max(at_least, _READ))
        self.read_bytes += len(chunk)
        if self.read_bytes > self.limit:
            raise too_large(self.limit)
        try:
            decoded = self.decoder.decode(chunk, final=not chunk)
        except UnicodeDecodeError:
            raise ServiceError("The request body is not valid UTF-8.") from None
        if self.pos > _READ:  # drop what was parsed: the buffer holds one value at a time
            self.text, self.pos = self.text[self.pos:], 0
        self.text += decoded
        self.eof = not chunk
        return True

    def peek(self) -> str:
        """The next character that is not whitespace ("" at the end)."""
        while True:
            found = _NOT_WHITESPACE.search(self.text, self.pos)
            if found is not None:
                self.pos = found.start()
                return self.text[self.pos]
            self.pos = len(self.text)
            if not self._more():
                return ""

    def _too_large(self) -> ServiceError:
        return ServiceError(f"A request is larger than {self.max_value} bytes (or not valid "
                            "JSON).", status=413, code="request_too_large")

    def expect(self, char: str) -> None:
        if self.peek() != char:
            raise ServiceError(f"The request body is not valid JSON: expected {char!r}.")
        self.pos += 1

    def value(self) -> Any:
        if self.peek() not in ("{", "[", '"'):
            # A number or literal ends only where a delimiter follows: "1" may be the start
            # of "10" or "1.5" in the next chunk. Each search looks at the new text only,
            # and each read doubles the pending text: linear, however long the value, and
            # no longer than a request may be.
            searched = 0  # of the pending text, searched already
            while not _DELIMITER.search(self.text, self.pos + searched):
                searched = len(self.text) - self.pos
                if searched > self.max_value:
                    raise self._too_large()
                if not self._more(searched):
                    break
        while True:
            try:
                value, end = raw_decode_strict(self.text, self.pos)
            except (ValueError, RecursionError):
                pending = len(self.text) - self.pos
                if pending > self.max_value:
                    raise self._too_large() from None
                if not self._more(pending):  # read as much again: parsing stays linear
                    raise ServiceError("The request body is not valid JSON.") from None
                continue
            self.pos = end
            return value


def iter_requests(stream: Readable, *, limit: int) -> Iterator[Any]:
    """The items of the body's `requests` array, one at a time (the only field)."""
    reader = _JsonStream(stream, limit=limit, max_value=settings.BATCHWEB["MAX_LINE_BYTES"])
    reader.expect("{")
    seen = False
    while reader.peek() != "}":
        if seen:
            reader.expect(",")
        key = reader.value()
        reader.expect(":")
        if key != "requests" or seen:
            raise ServiceError(f"{str(key)[:100]}: Extra inputs are not permitted"
                               if key != "requests" else "requests: given twice",
                               param=str(key)[:100])
        seen = True
        reader.expect("[")
        first = True
        while reader.peek() != "]":
            if not first:
                reader.expect(",")
            first = False
            yield reader.value()
        reader.expect("]")
    reader.expect("}")
    if reader.peek() != "":
        raise ServiceError("The request body is not valid JSON: data after the object.")
    if not seen:
        raise ServiceError("requests: Field required", param="requests")


def _input_line(index: int, item: Any) -> bytes:
    """The batch input line of one request (`requests[index]`): its params become the body
    of a /v1/messages request. Its params are checked by validation, and answered per
    request; only what makes no line is refused here."""
    where = f"requests.{index}"
    if not isinstance(item, dict) or set(item) != {"custom_id", "params"}:
        raise ServiceError(f"{where}: must be an object with exactly custom_id and params.",
                           param=where)
    custom_id, params = item["custom_id"], item["params"]
    if not isinstance(custom_id, str) or not CUSTOM_ID.fullmatch(custom_id):
        raise ServiceError(f"{where}.custom_id: must be 1 to 64 letters, digits, '_' or "
                           "'-'.", param=f"{where}.custom_id")
    if not isinstance(params, dict):
        raise ServiceError(f"{where}.params: must be an object.", param=f"{where}.params")
    line = {"custom_id": custom_id, "method": "POST", "url": MESSAGES, "body": params}
    try:
        return json.dumps(line, ensure_ascii=False).encode() + b"\n"
    except UnicodeEncodeError:
        raise ServiceError(f"{where}: has an unpaired surrogate escape, which is not valid "
                           "Unicode.", param=where) from None


def create_message_batch(*, owner: Any, body: Readable, declared_length: int,
                         api_key: Any = None) -> Batch:
    """A Message Batch from the create body: its requests written to an input file as they
    are read, then a batch of it as the OpenAI API would create. Refused whole (nothing
    stored) when the body is malformed or over the limit."""
    limit = settings.BATCHWEB["MESSAGE_BATCH_MAX_BYTES"]
    max_requests = Batch.request_limit(Batch.Api.ANTHROPIC)
    if declared_length > limit:
        raise too_large(limit)  # before reading any of it
    seen: set[str] = set()
    with local_temp(".jsonl") as path:
        with open(path, "wb") as out:
            for index, item in enumerate(iter_requests(body, limit=limit)):
                # Refused at the first request over the limit, before the rest is read:
                # the file's own check (on create_input_file) would come only after the
                # whole body was parsed and every custom_id held in `seen`.
                if index >= max_requests:
                    raise ServiceError(f"requests: a batch takes at most {max_requests} "
                                       "requests.", code="too_many_requests",
                                       param="requests")
                line = _input_line(index, item)
                # Anthropic refuses a batch with a custom_id twice at once (400).
                if item["custom_id"] in seen:
                    raise ServiceError(f"requests.{index}.custom_id: '{item['custom_id']}' "
                                       "is used by an earlier request; custom_ids must be "
                                       "unique.", param=f"requests.{index}.custom_id")
                seen.add(item["custom_id"])
                out.write(line)
        if not seen:
            raise ServiceError("requests: must hold at least one request.", param="requests")
        # Held to this API's limits as it was read: its lines, which name their method
        # and url, may be a little larger than the body was.
        file = create_input_file(owner=owner, path=path, filename="message_batch.jsonl",
                                 purpose=File.Purpose.BATCH, limits_checked=True)
    try:
        with transaction.atomic():
            batch = create_batch(owner=owner, input_file_id=file.pk, endpoint=MESSAGES,
                                 api_key=api_key,
                                 completion_window=WINDOW, api=Batch.Api.ANTHROPIC)
            # Anthropic counts every request as processing from the start, and keeps the
            # results MESSAGE_BATCH_RESULTS_DAYS after the batch ends.
            Batch.objects.filter(pk=batch.pk).update(
                total=len(seen), output_expires_after=results_seconds())
    except ServiceError:
        delete_file(file=file)  # a quota refused the batch: its input goes too
        raise
    return Batch.objects.get(pk=batch.pk)


def results_seconds() -> int | None:
    """How long a Message Batch's output and error files live after it ends (None:
    until deleted)."""
    days = settings.BATCHWEB["MESSAGE_BATCH_RESULTS_DAYS"]
    return int(days) * 86400 if days else None


def archive_results(*, file_id: str, now: datetime) -> int:
    """Retention is deleting `file_id`: archive the Message Batches whose results it
    holds (their output or error file, or the input a batch that failed validation answers
    from), as Anthropic archives a batch once its results are gone. Their request counts
    are kept first: a stopped batch's are counted in the error file. Returns how many
    were archived."""
    archived = 0
    batches = Batch.objects.filter(api=Batch.Api.ANTHROPIC, archived_at__isnull=True,
                                   status__in=Batch.ENDED).filter(
        Q(output_file_id=file_id) | Q(error_file_id=file_id)
        | Q(status=Batch.Status.FAILED, input_file_id=file_id))
    for batch in batches:
        archived += Batch.objects.filter(pk=batch.pk, archived_at__isnull=True).update(
            archived_at=now, archived_counts=anthropic.request_counts(batch))
    return archived


def delete_message_batch(*, batch: Batch) -> None:
    """Delete an ended Message Batch and its files (Anthropic deletes only ended batches;
    an active one is a 400 there, as here)."""
    if not batch.is_ended:
        raise wrong_state(f"Cannot delete a batch that is {batch.status}; cancel it and "
                          "wait for it to end.")
    file_ids = [batch.input_file_id, batch.output_file_id, batch.error_file_id]
    with transaction.atomic():
        if not Batch.objects.filter(pk=batch.pk, status__in=Batch.ENDED).delete()[0]:
            return
    for file in File.objects.filter(pk__in=[f for f in file_ids if f]):
        delete_file(file=file)
