"""One streaming pass over a batch input file: every line checked, shards cut, duplicates found.

Used by the validation task (before a batch runs) and by the dashboard's preflight (before a
batch exists), so both report the same problems with the same line numbers.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

from django.conf import settings

from jobs.digestset import DigestSet
from jobs.policy import CHUNK_TOKENS, LINE_TOKENS, VIOLATION, Screener, Violation
from jobs.services.files import iter_lines
from jobs.wire import (
    Code,
    LineError,
    RequestLine,
    dedup_key,
    estimate_tokens,
    parse_line,
    prompt_text,
)


@dataclass
class ShardPlan:
    index: int
    start_byte: int
    end_byte: int
    first_line: int
    lines: int = 0  # request lines inside the byte range
    # Requests this shard writes results for: its lines, minus copies of primaries held by
    # other shards, plus copies of its own primaries found anywhere.
    responsible: int = 0


@dataclass
class InputReport:
    endpoint: str | None = None
    model: str | None = None
    requests: int = 0
    errors: list[dict[str, Any]] = field(default_factory=list)
    error_count: int = 0
    shards: list[ShardPlan] = field(default_factory=list)
    dedup_saved: int = 0
    screened: int = 0  # lines a `skip` content rule keeps from running
    input_tokens_estimate: int = 0
    output_tokens_ceiling: int = 0

    @property
    def ok(self) -> bool:
        return self.error_count == 0


# (primary line, copy line, copy custom_id), written out as they are found.
CopySink = Callable[[int, int, str], None]
# (line, custom_id, rule name) of a line a `skip` content rule keeps from running.
ScreenSink = Callable[[int, str, str], None]


def served_models() -> dict[str, tuple[str, ...]]:
    """Model name -> the endpoints it serves, from settings."""
    return {m["name"]: tuple(m.get("endpoints", ())) for m in settings.BATCHWEB_MODELS}


def check_input(stream: IO[bytes], *, endpoint: str | None,
                on_copy: CopySink | None = None, screener: Screener | None = None,
                on_screened: ScreenSink | None = None) -> InputReport:
    """Check every line of a batch input file and plan its shards.

    `endpoint` is the batch's; None (the dashboard's preflight) takes the first line's.
    Duplicate deterministic bodies are reported to `on_copy`; with no sink they are only
    counted. Memory stays small: custom_ids are remembered as 8-byte digests and at most
    DEDUP_MAX_BODIES distinct bodies are remembered for dedup.

    With a `screener`, every line is checked against the content rules: a `reject` rule's
    violation is a line error; a `skip` rule's goes to `on_screened` and the line stays in
    the batch (its shard writes the error line).
    """
    conf = settings.BATCHWEB
    models = served_models()
    report = InputReport(endpoint=endpoint)
    seen_ids = DigestSet()
    primaries: dict[bytes, tuple[int, int]] = {}  # body digest -> (line, shard index)
    shard: ShardPlan | None = None
    # Lines waiting to be screened, a chunk at a time: (line number, custom_id, tokens,
    # text), their requests too when the screener counts tokens (`needs_requests`, asked at
    # the first line), and the chunk's size as CHUNK_TOKENS counts it.
    to_screen: list[tuple[int, str, int, str]] = []
    to_screen_requests: list[RequestLine] = []
    to_screen_size = 0
    keep_requests: bool | None = None

    def problem(line_number: int, error: LineError) -> None:
        report.error_count += 1
        if len(report.errors) < conf["MAX_ERRORS_REPORTED"]:
            report.errors.append(error.entry(line_number))

    def screened(line_number: int, custom_id: str, violation: Violation) -> None:
        if violation.action == "reject":
            problem(line_number, LineError(VIOLATION, violation.message, "body"))
        else:
            report.screened += 1
            if on_screened:
                on_screened(line_number, custom_id, violation.rule)

    for line in iter_lines(stream, max_line_bytes=conf["MAX_LINE_BYTES"]):
        if line.content is None:
            problem(line.number, LineError(
                Code.LINE_TOO_LONG, f"Line is longer than {conf['MAX_LINE_BYTES']} bytes."))
            continue
        if not line.content.strip():
            continue
        parsed = parse_line(line.content, max_tokens_cap=conf["MAX_TOKENS_CAP"])
        if isinstance(parsed, LineError):
            problem(line.number, parsed)
            continue
        error = _check_against_batch(parsed, report, models, seen_ids)
        if error:
            problem(line.number, error)
            continue
        report.requests += 1
        if report.requests > conf["MAX_REQUESTS_PER_BATCH"]:
            problem(line.number, LineError(
                Code.TOO_MANY_REQUESTS,
                f"A batch takes at most {conf['MAX_REQUESTS_PER_BATCH']} requests."))
            break
        text, chars = prompt_text(parsed)
        tokens_in, ceiling = estimate_tokens(parsed, chars)
        if screener is not None:
            if keep_requests is None:
                keep_requests = screener.needs_requests(parsed.model)
            to_screen.append((line.number, parsed.custom_id, tokens_in, text))
            if keep_requests:
                to_screen_requests.append(parsed)
            to_screen_size += tokens_in + LINE_TOKENS
            if to_screen_size >= CHUNK_TOKENS:
                screener.screen(to_screen, screened, to_screen_requests)
                to_screen, to_screen_requests, to_screen_size = [], [], 0
        report.input_tokens_estimate += tokens_in
        report.output_tokens_ceiling += ceiling

        if shard is None or shard.lines >= conf["SHARD_SIZE"]:
            shard = ShardPlan(index=len(report.shards), start_byte=line.start,
                              end_byte=line.end, first_line=line.number)
            report.shards.append(shard)
        shard.end_byte = line.end
        shard.lines += 1
        shard.responsible += 1

        key = dedup_key(parsed)
        if key is None:
            continue
        primary = primaries.get(key)
        if primary is None:
            if len(primaries) < conf["DEDUP_MAX_BODIES"]:
                primaries[key] = (line.number, shard.index)
            continue
        primary_line, primary_shard = primary
        report.dedup_saved += 1
        shard.responsible -= 1
        report.shards[primary_shard].responsible += 1
        if on_copy:
            on_copy(primary_line, line.number, parsed.custom_id)

    if screener is not None:
        screener.screen(to_screen, screened, to_screen_requests)
        screener.flush(screened)
        report.errors.sort(key=lambda entry: entry["line"] or 0)
    if report.requests == 0 and report.error_count == 0:
        problem(1, LineError(Code.EMPTY_FILE, "The file has no requests."))
    if report.error_count:
        report.shards = []
    return report


def _check_against_batch(line: RequestLine, report: InputReport,
                         models: dict[str, tuple[str, ...]],
                         seen_ids: DigestSet) -> LineError | None:
    """The rules that relate a line to the rest of the batch."""
    if report.endpoint is None:
        report.endpoint = line.url
    elif line.url != report.endpoint:
        return LineError(Code.MISMATCHED_ENDPOINT,
                         f"url {line.url} differs from the batch's endpoint {report.endpoint}.",
                         "url")
    served = models.get(line.model)
    if served is None:
        return LineError(Code.MODEL_NOT_FOUND, f"The model '{line.model}' is not served here.",
                         "body.model")
    if line.url not in served:
        return LineError(Code.MODEL_NOT_FOUND,
                         f"The model '{line.model}' does not serve {line.url}.", "body.model")
    if report.model is None:
        report.model = line.model
    elif line.model != report.model:
        return LineError(Code.MISMATCHED_MODEL,
                         f"All requests of a batch must use one model; this line uses "
                         f"'{line.model}', earlier lines '{report.model}'.", "body.model")
    digest = int.from_bytes(hashlib.blake2b(line.custom_id.encode(), digest_size=8).digest())
    if digest in seen_ids:
        return LineError(Code.DUPLICATE_CUSTOM_ID,
                         f"custom_id {json.dumps(line.custom_id)[:200]} appears more than once.",
                         "custom_id")
    seen_ids.add(digest)
    return None
