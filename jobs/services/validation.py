"""One streaming pass over a batch input file: every line checked, shards cut, duplicates found,
content rules applied, prompt prefixes keyed and, where it pays, shards grouped by prefix;
and the validation task that runs it before a batch starts.

Two kinds of problems, one rule each (as OpenAI's Batch API and the seeds have it):
- a *file problem* fails the batch, every problem listed by line in `errors.data`: a line
  that is not JSON or not an object, a missing, non-string or duplicate custom_id, a method
  other than POST, a url other than the batch's, a model that is missing, differs from the
  first line's or is not served, a line over the size limit, more requests than the limit,
  a `reject_batch` content rule;
- a *request problem* fails that request only: a body the endpoint refuses (`Endpoint.check`:
  types, ranges, unknown fields, media outside the allowed domains) or a `reject` content
  rule. The line runs nowhere; its shard writes the endpoint's 400 to the error file
  (`wire.refused_line`), counted as a failed request. A `strict` batch makes every request
  problem a file problem, so nothing runs unless every line is right.
A `skip` content rule's line is the operator's filter, not a problem: it goes to the error
file as `content_policy_violation` whether the batch is strict or not.

The dashboard's preflight (before a batch exists) runs the same check (`check_batch_input`),
so both report the same problems with the same line numbers.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone
from redis import RedisError

from jobs.capacity.fleet import kv_cache_tokens
from jobs.formats.anthropic import params_named
from jobs.formats.prefix_keys import prefix_key
from jobs.formats.prompts import Room, ceiling, estimate_tokens, prompt_text, room_for
from jobs.formats.wire import (
    Code,
    LineError,
    RequestLine,
    parse_line,
    quoted,
)
from jobs.lib import queues
from jobs.lib.digestset import DigestSet
from jobs.lib.model_registry import served_endpoints
from jobs.models import Batch, LoraAdapter, RequestCopy, ScreenedLine, Shard
from jobs.policy import VIOLATION, Screener, ScreeningChunker, Violation
from jobs.services.budgets import Estimate, estimate
from jobs.services.evals import eval_ceiling
from jobs.services.finalize import notify_ended
from jobs.services.planning import CopySink, ShardPlan, ShardPlanner
from jobs.services.prefix_plan import GroupedShard, PrefixPlan, PrefixPlanner
from jobs.services.scheduling import enqueue_next_shards
from jobs.services.stopping import stop_changed_input
from jobs.storage.external import ObjectChanged
from jobs.storage.line_index import write_line_index
from jobs.storage.lines import Line, iter_lines
from jobs.storage.objects import open_file
from jobs.storage.temp import local_temp


@dataclass
class InputReport:
    endpoint: str | None = None
    model: str | None = None
    requests: int = 0
    errors: list[dict[str, Any]] = field(default_factory=list)
    error_count: int = 0
    shards: list[ShardPlan] = field(default_factory=list)
    # What prefix planning decided; when it grouped, the line index records in run order
    # and the grouped shards replace `shards`.
    plan: PrefixPlan = field(default_factory=PrefixPlan)
    line_records: Any = None
    grouped_shards: list[GroupedShard] = field(default_factory=list)
    dedup_saved: int = 0
    screened: int = 0  # lines a `skip` content rule keeps from running
    # Request problems (not of a strict batch): these requests fail, the others run. The
    # first MAX_ERRORS_REPORTED are listed as `errors` entries are.
    refused: int = 0
    refused_lines: list[dict[str, Any]] = field(default_factory=list)
    # The most the requests that run can use, by the model each names (an adapter is
    # priced as itself): [input tokens, output tokens] (jobs.formats.prompts.ceiling).
    ceilings: dict[str, list[int]] = field(default_factory=dict)
    # The prompts' tokens as estimated for planning (~4 characters a token) of the
    # requests that run: with their output limits, the work the capacity plan prices.
    prompt_tokens: int = 0

    @property
    def input_tokens_ceiling(self) -> int:
        return sum(tokens[0] for tokens in self.ceilings.values())

    @property
    def output_tokens_ceiling(self) -> int:
        return sum(tokens[1] for tokens in self.ceilings.values())

    @property
    def first_model(self) -> str | None:
        """The model the first request that runs names (an eval run runs with it)."""
        return next(iter(self.ceilings), self.model)

    @property
    def cost(self) -> Estimate:
        """The most the batch's requests could cost (jobs.services.budgets)."""
        return estimate(model=self.model, ceilings=self.ceilings)

    @property
    def ok(self) -> bool:
        return self.error_count == 0

    @property
    def runnable(self) -> int:
        """The requests that will run: all but those failed or skipped without running."""
        return max(0, self.requests - self.refused - self.screened)


# (line, custom_id, what keeps it from running) of a line validation keeps from running: a
# `skip` content rule's name (str) or a request problem (LineError).
ScreenSink = Callable[[int, str, "str | LineError"], object]


class LineChecker:
    """The rules of each input line, alone (its size, its JSON, the request's shape) and
    against the lines before it (one endpoint, a model served for it and the same on every
    line, unique custom_ids, at most `Batch.request_limit` requests). A body the endpoint
    refuses is the line's request problem (`RequestLine.refused`), or, if `strict`, its
    line error."""

    def __init__(self, *, endpoint: str | None, strict: bool = False,
                 api: str = Batch.Api.OPENAI) -> None:
        conf = settings.BATCHWEB
        self.max_line_bytes: int = conf["MAX_LINE_BYTES"]
        self.max_tokens_cap: int = conf["MAX_TOKENS_CAP"]
        self.media_domains: list[str] = conf["MEDIA_ALLOWED_DOMAINS"]
        self.max_requests: int = Batch.request_limit(api)
        self.models = served_endpoints()
        # Registered LoRA adapters whose base model loads them (read from the database the
        # first time a line names no served model): a line naming one runs on its base
        # model, which is then the batch's model.
        self.adapters: dict[str, str] | None = None
        self.endpoint = endpoint  # None (the dashboard's preflight) takes the first line's
        self.strict = strict
        self.api = api
        self.model: str | None = None
        self.requests = 0  # lines that passed, and the one over the limit
        # custom_ids remembered as 8-byte digests, so memory stays small.
        self.seen_ids = DigestSet()

    @property
    def full(self) -> bool:
        """Whether a line went over the request limit: the rest is not read."""
        return self.requests > self.max_requests

    def check(self, line: Line) -> RequestLine | LineError | None:
        """The line's request, its problem, or None for a blank line. A Message Batch's
        problems name the request's fields as its user wrote them (`params.…`)."""
        checked = self._check(line)
        if self.api != Batch.Api.ANTHROPIC:
            return checked
        if isinstance(checked, LineError):
            return params_named(checked)
        if checked is not None and checked.refused is not None:
            return replace(checked, refused=params_named(checked.refused))
        return checked

    def _check(self, line: Line) -> RequestLine | LineError | None:
        if line.content is None:
            return LineError(Code.LINE_TOO_LONG,
                             f"Line is longer than {self.max_line_bytes} bytes.")
        if not line.content.strip():
            return None
        parsed = parse_line(line.content, max_tokens_cap=self.max_tokens_cap,
                            media_domains=self.media_domains)
        if isinstance(parsed, LineError):
            return parsed
        if self.strict and parsed.refused is not None:
            return parsed.refused
        error = self._against_batch(parsed)
        if error:
            return error
        self.requests += 1
        if self.requests > self.max_requests:
            return LineError(Code.TOO_MANY_REQUESTS,
                             f"A batch takes at most {self.max_requests} requests.")
        return parsed

    def _against_batch(self, line: RequestLine) -> LineError | None:
        """The rules that relate a line to the rest of the batch."""
        if self.endpoint is None:
            self.endpoint = line.url
        elif line.url != self.endpoint:
            return LineError(Code.MISMATCHED_ENDPOINT,
                             f"url {line.url} differs from the batch's endpoint "
                             f"{self.endpoint}.", "url")
        model = line.model
        if model not in self.models:
            if self.adapters is None:
                self.adapters = LoraAdapter.objects.usable()
            model = self.adapters.get(model, model)
        served = self.models.get(model)
        if served is None:
            return LineError(Code.MODEL_NOT_FOUND,
                             f"The model {quoted(line.model)} is not served here.",
                             "body.model")
        if line.url not in served:
            return LineError(Code.MODEL_NOT_FOUND,
                             f"The model {quoted(model)} does not serve {line.url}.",
                             "body.model")
        if self.model is None:
            self.model = model
        elif model != self.model:
            if model != line.model:
                return LineError(Code.MISMATCHED_MODEL,
                                 f"The adapter {quoted(line.model)} is for the model "
                                 f"{quoted(model)}; this batch's requests run on "
                                 f"{quoted(self.model)}.", "body.model")
            return LineError(Code.MISMATCHED_MODEL,
                             f"All requests of a batch must use one model; this line uses "
                             f"{quoted(line.model)}, earlier lines {quoted(self.model)}.",
                             "body.model")
        if not self.seen_ids.add_new(line.custom_id):
            return LineError(Code.DUPLICATE_CUSTOM_ID,
                             f"custom_id {quoted(line.custom_id)} appears more than once.",
                             "custom_id")
        return None


def check_input(stream: IO[bytes], *, endpoint: str | None, strict: bool = False,
                on_copy: CopySink | None = None, screener: Screener | None = None,
                on_screened: ScreenSink | None = None,
                api: str = Batch.Api.OPENAI) -> InputReport:
    """Check every line of a batch input file (`LineChecker`) and plan its shards
    (`ShardPlanner`, which reports duplicate bodies to `on_copy`).

    `endpoint` is the batch's; None (the dashboard's preflight) takes the first line's.
    `api`, the one the batch was created through, sets how many requests it may hold.

    A request problem (see the module docstring) goes to `on_screened` with its LineError
    and the line stays in the batch (its shard writes the error line); if `strict`, it is a
    file problem instead. With a `screener`, every line is checked against the content
    rules, a chunk at a time (`ScreeningChunker`): a `reject` rule's violation is a request
    problem, a `reject_batch` rule's a file problem, and a `skip` rule's goes to
    `on_screened` with the rule's name.
    """
    conf = settings.BATCHWEB
    report = InputReport(endpoint=endpoint)
    checker = LineChecker(endpoint=endpoint, strict=strict, api=api)
    planner = ShardPlanner(shard_size=conf["SHARD_SIZE"], max_bodies=conf["DEDUP_MAX_BODIES"],
                           on_copy=on_copy)
    prefixes = PrefixPlanner(shard_size=conf["SHARD_SIZE"],
                             cache_tokens=conf["PREFIX_CACHE_TOKENS_DEFAULT"],  # see below
                             min_gain=conf["PREFIX_MIN_GAIN"], enabled=conf["PREFIX_GROUPING"])

    def problem(line_number: int, error: LineError) -> None:
        report.error_count += 1
        if len(report.errors) < conf["MAX_ERRORS_REPORTED"]:
            report.errors.append(error.entry(line_number))

    def request_problem(line_number: int, custom_id: str, error: LineError) -> None:
        if strict:
            problem(line_number, error)
            return
        report.refused += 1
        if len(report.refused_lines) < conf["MAX_ERRORS_REPORTED"]:
            report.refused_lines.append({"custom_id": custom_id, **error.entry(line_number)})
        if on_screened:
            on_screened(line_number, custom_id, error)

    def screened(line_number: int, custom_id: str, violation: Violation) -> None:
        error = LineError(VIOLATION, violation.message, "body")
        if violation.action == "reject_batch":
            problem(line_number, error)
        elif violation.action == "reject":
            request_problem(line_number, custom_id, error)
        else:
            report.screened += 1
            if on_screened:
                on_screened(line_number, custom_id, violation.rule)

    chunker = ScreeningChunker(screener, screened) if screener is not None else None
    room: Room | None = None  # the batch's model's, once a line names it
    for line in iter_lines(stream, max_line_bytes=checker.max_line_bytes):
        request = checker.check(line)
        if request is None:
            continue
        if isinstance(request, LineError):
            problem(line.number, request)
            if checker.full:
                break
            continue
        if request.refused is not None:
            # Nothing to screen, estimate or share: it never runs.
            request_problem(line.number, request.custom_id, request.refused)
        text, chars = prompt_text(request)
        tokens_in = estimate_tokens(request, chars)
        if chunker is not None and request.refused is None:
            chunker.add(line.number, request, tokens_in, text)
        if request.refused is None:
            report.prompt_tokens += tokens_in
            room = room or room_for(checker.model)
            most = report.ceilings.setdefault(request.model, [0, 0])
            most[0], most[1] = (a + b for a, b in zip(most, ceiling(request, room),
                                                      strict=True))
        primary = planner.add(line, request)
        if primary is None:
            key = prefix_key(request) if prefixes.enabled and request.refused is None else None
            prefixes.add(line, key, tokens_in)
        else:
            prefixes.add_copy(primary)

    report.endpoint, report.model, report.requests = (checker.endpoint, checker.model,
                                                      checker.requests)
    report.shards, report.dedup_saved = planner.shards, planner.dedup_saved
    if chunker is not None:
        chunker.finish()
        report.errors.sort(key=lambda entry: entry["line"] or 0)
        report.refused_lines.sort(key=lambda entry: entry["line"] or 0)
    if report.requests == 0 and report.error_count == 0:
        problem(1, LineError(Code.EMPTY_FILE, "The file has no requests."))
    if report.error_count:
        report.shards = []
    else:
        if prefixes.enabled:
            prefixes.cache_tokens = planning_cache_tokens(report.model)
        report.plan, report.line_records, report.grouped_shards = prefixes.finish()
    return report


def planning_cache_tokens(model: str | None) -> int:
    """The prefix cache, in tokens, that prefix planning assumes for `model`'s engines:
    BATCHWEB_PREFIX_CACHE_TOKENS when set; else the smallest KV cache its live workers
    report (jobs.worker.presence); else, while none has, PREFIX_CACHE_TOKENS_DEFAULT."""
    conf = settings.BATCHWEB
    if conf["PREFIX_CACHE_TOKENS"]:
        return int(conf["PREFIX_CACHE_TOKENS"])
    reported = None
    if model:
        try:
            reported = kv_cache_tokens(queues.connection(), model,
                                       max_age=conf["HEARTBEAT_TIMEOUT_SECONDS"])
        except RedisError:  # the queue away: plan with the default
            reported = None
    return reported or int(conf["PREFIX_CACHE_TOKENS_DEFAULT"])


def check_batch_input(stream: IO[bytes], *, endpoint: str | None, strict: bool = False,
                      on_copy: CopySink | None = None,
                      on_screened: ScreenSink | None = None,
                      api: str = Batch.Api.OPENAI) -> InputReport:
    """What validation decides about a batch input file: `check_input` with the enabled
    content rules. The validation task and the dashboard's preflight both call it, so the
    preflight shows exactly what validation would decide."""
    return check_input(stream, endpoint=endpoint, strict=strict, on_copy=on_copy,
                       screener=Screener.load(), on_screened=on_screened, api=api)


# --- the validation task ---


def run_validation(*, batch_id: str) -> None:
    """Stream the input once; fail the batch with every bad line, or plan its shards and
    start it. Does nothing unless the batch is still validating."""
    try:
        _validate(batch_id)
    except ObjectChanged as exc:
        # Its input, read in place from its owner's bucket, is not the registered version:
        # it fails naming why, rather than being checked (and run) on other data.
        stop_changed_input(batch_id=batch_id, reason=str(exc))


def _validate(batch_id: str) -> None:
    batch = Batch.objects.select_related("input_file").filter(pk=batch_id).first()
    if batch is None or batch.status != Batch.Status.VALIDATING or batch.stop_code:
        return
    with local_temp(".copies") as copies_path, local_temp(".screened") as screened_path:
        with open(copies_path, "w") as copies, open(screened_path, "w") as screened, \
                open_file(batch.input_file) as stream:
            report = check_batch_input(
                stream, endpoint=batch.endpoint, strict=batch.strict, api=batch.api,
                on_copy=lambda p, line, cid: copies.write(json.dumps([p, line, cid]) + "\n"),
                on_screened=lambda line, cid, why: screened.write(
                    json.dumps([line, cid, why if isinstance(why, str) else why.entry(line)])
                    + "\n"))
        if not report.ok:
            errors = report.errors
            if report.error_count > len(errors):
                errors.append({"code": "too_many_errors", "line": None, "param": None,
                               "message": f"{report.error_count} lines have problems; "
                                          f"the first {len(errors)} are listed."})
            now = timezone.now()
            # Unless it was cancelled or expired meanwhile: then it ends so, each request
            # with its batch_cancelled / batch_expired line.
            if Batch.objects.filter(pk=batch_id, status=Batch.Status.VALIDATING,
                                    stop_code="").update(
                    status=Batch.Status.FAILED, failed_at=now, errors=errors):
                transaction.on_commit(lambda: notify_ended(batch_id), robust=True)
            return
        # Stored before the batch starts: its shards read it.
        line_index = (write_line_index(batch_id, report.line_records)
                      if report.plan.grouped else "")
        with transaction.atomic():
            started = Batch.objects.filter(
                pk=batch_id, status=Batch.Status.VALIDATING, stop_code="").update(
                status=Batch.Status.IN_PROGRESS, in_progress_at=timezone.now(),
                total=report.requests, model=report.model or "",
                dedup_saved=report.dedup_saved, plan=report.plan.to_json(),
                line_index=line_index, cost_ceiling_nanos=_ceiling(batch, report),
                work_input_tokens=report.prompt_tokens,
                work_output_tokens=report.output_tokens_ceiling)
            if not started:
                return
            Shard.objects.bulk_create(_shard_rows(batch_id, report, queues.shard_queue_name(
                report.model or "", batch.priority)), batch_size=500)
            _save_copies(batch_id, copies_path)
            _save_screened(batch_id, screened_path)
            transaction.on_commit(lambda: enqueue_next_shards(batch_id=batch_id), robust=True)


def _ceiling(batch: Batch, report: InputReport) -> int:
    """The batch's cost ceiling: its requests', and its attached eval set's."""
    cost = report.cost
    if batch.eval_set is not None and report.model:
        cost = cost.plus(eval_ceiling(eval_set=batch.eval_set, model=report.model,
                                      first_model=report.first_model))
    return cost.ceiling_nanos


def _shard_rows(batch_id: str, report: InputReport, queue_name: str) -> list[Shard]:
    if report.plan.grouped:
        return [Shard(batch_id=batch_id, index=plan.index, start_byte=0, end_byte=0,
                      first_line=plan.first_line, lines_from=plan.lines_from,
                      lines_to=plan.lines_to, request_count=plan.responsible,
                      queue_name=queue_name)
                for plan in report.grouped_shards]
    return [Shard(batch_id=batch_id, index=plan.index, start_byte=plan.start_byte,
                  end_byte=plan.end_byte, first_line=plan.first_line,
                  request_count=plan.responsible, queue_name=queue_name)
            for plan in report.shards]


def _save_screened(batch_id: str, path: Path) -> None:
    def row(line: int, custom_id: str, why: str | dict[str, Any]) -> ScreenedLine:
        if isinstance(why, str):  # a `skip` rule's name
            return ScreenedLine(batch_id=batch_id, line=line, custom_id=custom_id, rule=why)
        return ScreenedLine(batch_id=batch_id, line=line, custom_id=custom_id,
                            code=why["code"], param=why["param"] or "",
                            message=why["message"])

    _bulk_save(path, row)


def _save_copies(batch_id: str, path: Path) -> None:
    _bulk_save(path, lambda primary_line, line, custom_id: RequestCopy(
        batch_id=batch_id, primary_line=primary_line, line=line, custom_id=custom_id))


def _bulk_save(path: Path, make_row: Callable[..., Any], chunk_size: int = 2000) -> None:
    """Insert one row per line of a JSONL file of argument lists, a chunk at a time, so a
    batch with a million copies or screened lines never holds them all in memory."""
    chunk: list[Any] = []
    with open(path) as handle:
        for row in handle:
            chunk.append(make_row(*json.loads(row)))
            if len(chunk) >= chunk_size:
                type(chunk[0]).objects.bulk_create(chunk)
                chunk = []
    if chunk:
        type(chunk[0]).objects.bulk_create(chunk)
