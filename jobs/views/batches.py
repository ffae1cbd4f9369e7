"""Batch pages: list, new batch (upload + preflight), batch page with live progress, the
errors / results / spot-check tabs, cancel, rerun and downloads.

Views are thin: they parse the request, call a service and pick a template or a partial.
A request from htmx gets only the partial it targets (`template#partial`); the same URL
without htmx renders the whole page, so every link works without JavaScript.
"""

from __future__ import annotations

import functools
import hashlib
import random
import re
import time
from typing import Any
from urllib.parse import urlencode

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.cache import cache, caches
from django.core.paginator import Page, Paginator
from django.http import Http404, HttpResponse, StreamingHttpResponse
from django.http.response import HttpResponseBase
from django.shortcuts import redirect, render
from django.template.loader import render_to_string
from django.urls import reverse
from django.utils import timezone
from django.utils.cache import get_conditional_response, patch_cache_control
from django.utils.safestring import mark_safe
from django.utils.text import slugify
from django.views.decorators.http import require_GET, require_POST
from django_htmx.http import HttpResponseClientRedirect, HttpResponseStopPolling

from jobs.formats import result_lines
from jobs.http.polls import remember
from jobs.http.web import LIST_PAGE_SIZE, SignedInRequest, download_response, uploaded_path
from jobs.lib import heavy
from jobs.lib.errors import ServiceError
from jobs.models import Batch, File
from jobs.policy.quality import FLAG_LABELS, FLAGS
from jobs.queries import dashboard, flags, queue_health, results, spot_samples, usage
from jobs.queries.evals import batch_record, engines_of
from jobs.services import preflight, rerun, spotcheck
from jobs.services.batches import (
    count_batches,
    create_batch,
    get_batch_for_user,
    newest_batches,
)
from jobs.services.budgets import budget_for
from jobs.services.files import create_input_file, get_file_for_user
from jobs.services.pricing import format_cost, rates_for
from jobs.services.progress import batch_version
from jobs.services.references import register_reference
from jobs.services.stopping import cancel_batch
from jobs.views.forms import NewBatchForm, ResultFilterForm, SpotCheckForm

BUSY_RETRY_SECONDS = 2
# Polling of a running batch (its page's live block, its row in the list): every 2 s, each
# page's period spread by +-15% so that many open pages do not all ask at the same instant.
# While the batch does not change the page lets polls pass, up to 30 s apart (static/js/
# app.js): the polling URL stays the same, so each such poll is the browser revalidating
# its copy, which the poll memo (jobs.http.polls) answers without Django.
POLL_MIN_SECONDS = 2
POLL_MAX_SECONDS = 30
POLL_JITTER = 0.15
_SEED = re.compile(r"[0-9a-f]{1,16}")
# Time-derived figures of the live block (elapsed, throughput now, ETA) are refreshed at
# least this often even when nothing else changed.
LIVE_STALE_SECONDS = 60
# The ETAs of the list's running batches (time-derived too) are at most this old.
LIST_STALE_SECONDS = 10
LIVE_CACHE_SECONDS = 300
# Rendered rows of ended batches (see _rows), in each web process's memory: reading them
# from Redis would cost about what rendering them does.
_ENDED_ROWS = caches["local"]
ENDED_ROW_SECONDS = 3600
STATUS_FILTERS = [("", "all"), ("active", "active"), *[(s, s.replace("_", " "))
                                                       for s in Batch.Status.values]]


def _get_batch_for_user(request: SignedInRequest, batch_id: str) -> Batch:
    """The signed-in user's batch (with live counts), or 404: another user's id looks
    exactly like one that does not exist."""
    try:
        return get_batch_for_user(owner=request.user, batch_id=batch_id)
    except ServiceError:
        raise Http404("No such batch.") from None


def _busy(request: SignedInRequest) -> HttpResponse:
    """429 for a heavy view while the same user's previous one still computes (see
    jobs.lib.heavy): said plainly, with when to try again."""
    response = render(request, "jobs/busy.html", status=429)
    response["Retry-After"] = str(BUSY_RETRY_SECONDS)
    return response


def _guard(request: SignedInRequest) -> heavy.Guard:
    return heavy.one_per_user(request.user.pk)


def _poll(batch: Batch, url_name: str, version: str, seed: str = "") -> dict[str, Any]:
    """Where and how often a running batch's block polls: its URL carries the page's
    jitter seed (`seed` of the poll being answered, a new one on a first render), so that a
    repeated poll gets the same answer (and its 304) and the period stays the page's own.
    The version lets the page tell an unchanged answer from a new one (static/js/app.js)."""
    if not _SEED.fullmatch(seed):
        seed = f"{random.getrandbits(32):08x}"
    spread = random.Random(seed).uniform(1 - POLL_JITTER, 1 + POLL_JITTER)
    return {"url": f"{reverse(url_name, args=[batch.pk])}?{urlencode({'seed': seed})}",
            "every": f"{POLL_MIN_SECONDS * spread:.1f}", "max": POLL_MAX_SECONDS,
            "version": version}


def _row(batch: Batch, seed: str = "") -> dict[str, Any]:
    shares = dashboard.BatchProgress.of(batch)
    # Its ETA is the capacity plan's projection, the API's `expected_completion_at`.
    projection = batch.projection()
    return {"batch": batch, "progress": batch.progress(), "done": shares.done,
            "projection": projection, "eta": projection.seconds_left(timezone.now()),
            "pct": shares.percent, "pct_completed": shares.percent_completed,
            "pct_failed": shares.percent_failed,
            "poll": _poll(batch, "batch_row", batch_version(batch), seed)}


def _rows(page_batches: list[Batch]) -> list[dict[str, Any]]:
    """The list's rows; an ended batch's as its HTML (`html`), rendered once per process and
    version: nothing an ended batch's row shows moves any more (no ETA, no polling), and
    most rows of a list are ended batches."""
    rows = []
    for batch in page_batches:
        if not batch.is_ended:
            rows.append(_row(batch))
            continue
        key = "batch-row:" + batch_version(batch, batch.endpoint, batch.created_at,
                                           sorted((batch.metadata or {}).items()))
        html = _ENDED_ROWS.get(key)
        if html is None:
            html = render_to_string("jobs/batch_list.html#batch-row", {"row": _row(batch)})
            _ENDED_ROWS.set(key, html, ENDED_ROW_SECONDS)
        rows.append({"batch": batch, "html": mark_safe(html)})
    return rows


# --- list ---


@login_required
@require_GET
def batch_list(request: SignedInRequest) -> HttpResponse:
    status = request.GET.get("status", "")
    if status != "active" and status not in Batch.Status.values:
        status = ""
    number = request.GET.get("page")
    first = not status and number in (None, "", "1")
    page: Page[Any]
    if first:
        # The first page of all batches, which open dashboards poll: cheaper queries.
        numbers: range | list[Batch] = range(count_batches(owner=request.user))
        page = Paginator(numbers, LIST_PAGE_SIZE).get_page(1)
        page_batches = page.object_list = newest_batches(owner=request.user,
                                                         count=LIST_PAGE_SIZE)
    else:
        # Explicit order, the one the API's lists use (newest first, ties by id).
        batches = Batch.objects.filter(owner=request.user).order_by("-created_at", "-pk")
        if status == "active":
            batches = batches.exclude(status__in=Batch.ENDED)
        elif status:
            batches = batches.filter(status=status)
        page = Paginator(batches, LIST_PAGE_SIZE).get_page(number)
        page_batches = list(page.object_list)
    rows = _rows(page_batches)
    context = {"page": page, "rows": rows,
               "status": status, "status_filters": STATUS_FILTERS}
    template = "jobs/batch_list.html"
    if request.htmx and not request.htmx.boosted:
        template += "#batch-table"
    response = render(request, template, context)
    if first:
        # The table is replayed to this browser's next requests while its batches are
        # unchanged (jobs.http.polls), until the running ones' ETAs are due again, and
        # never past a projection's moment (Batch.projection).
        remember(response, seconds=min([LIST_STALE_SECONDS, *(
            row["projection"].fresh_for for row in rows if "projection" in row)]))
    return response


@login_required
@require_GET
def batch_row(request: SignedInRequest, batch_id: str) -> HttpResponse:
    """One row of the list, polled while the batch runs; 286 stops polling once it ended."""
    batch = _get_batch_for_user(request, batch_id)
    context = {"row": _row(batch, request.GET.get("seed", ""))}
    if batch.is_ended:
        return HttpResponseStopPolling(
            render_to_string("jobs/batch_list.html#batch-row", context, request=request))
    return render(request, "jobs/batch_list.html#batch-row", context)


# --- new batch ---


def _check(request: SignedInRequest, data: dict[str, Any]) -> tuple[File | None,
                                                               preflight.Preflight]:
    """Check the uploaded or chosen file. An upload is stored only when it has no problems,
    so a bad file never becomes a File (the user fixes it and uploads again)."""
    endpoint = data.get("endpoint") or None
    strict = bool(data.get("strict"))
    upload = data.get("upload")
    if upload:
        with uploaded_path(upload) as path:
            result = preflight.check_path(path, endpoint=endpoint, strict=strict)
            if not result.ok:
                return None, result
            file = create_input_file(owner=request.user, path=path,
                                     filename=upload.name or "", purpose="batch")
        return file, result
    if data.get("source"):
        # Registered (read once, in place) before the check; the check then reads it by
        # range as it reads a stored file.
        file = register_reference(owner=request.user, source=data["source"], purpose="batch")
        return file, preflight.check_file(file, endpoint=endpoint, strict=strict,
                                          guard=_guard(request))
    if data.get("file_id"):
        file = get_file_for_user(owner=request.user, file_id=data["file_id"])
        return file, preflight.check_file(file, endpoint=endpoint, strict=strict,
                                          guard=_guard(request))
    raise ServiceError("Upload a JSONL file, choose one you uploaded before, or name an "
                       "object you may read (s3://bucket/key).")


def _submit(request: SignedInRequest, data: dict[str, Any]) -> tuple[Batch | None,
                                                                preflight.Preflight]:
    """Create the batch from the uploaded or chosen file in one step, unless the file has
    problems (then they are shown, as a check would)."""
    endpoint = data.get("endpoint") or None
    file, result = _check(request, data)
    if file is None or not result.ok:
        return None, result
    if data.get("model") and data["model"] != result.report.model:
        file = preflight.with_model(file=file, model=data["model"], owner=request.user)
        result = preflight.check_file(file, endpoint=endpoint, strict=bool(data.get("strict")),
                                      guard=_guard(request))
    if not result.ok:
        return None, result
    batch = create_batch(owner=request.user, input_file_id=file.pk,
                         endpoint=endpoint or result.report.endpoint,
                         completion_window=data["completion_window"],
                         metadata=data["metadata"], priority=data["priority"],
                         strict=bool(data.get("strict")), eval_set=data.get("eval_set"),
                         output_prefix=data.get("output_prefix"))
    return batch, result


@login_required
def batch_new(request: SignedInRequest) -> HttpResponse:
    result: preflight.Preflight | None = None
    checked: File | None = None
    if request.method == "POST":
        form = NewBatchForm(request.POST, request.FILES, owner=request.user)
        if form.is_valid():
            data = form.cleaned_data
            try:
                if request.POST.get("action") == "submit":
                    batch, result = _submit(request, data)
                    if batch is not None:
                        url = reverse("batch_detail", args=[batch.pk])
                        if request.htmx:
                            return HttpResponseClientRedirect(url)
                        return redirect(url)
                else:
                    checked, result = _check(request, data)
            except ServiceError as exc:
                form.add_error(None, exc.message)
            except heavy.Busy:
                return _busy(request)
            if checked is not None and result is not None and result.ok:
                # A fresh form: the stored file is now the one to submit, with the endpoint
                # and model the file asks for as suggestions.
                form = NewBatchForm(owner=request.user, initial={
                    **{k: request.POST.get(k) for k in
                       ("completion_window", "priority", "metadata", "strict",
                        "eval_set", "output_prefix")},
                    "file_id": checked.pk,
                    "endpoint": data.get("endpoint") or result.report.endpoint,
                    "model": data.get("model") or result.report.model})
    else:
        initial = {}
        if request.GET.get("file_id"):
            initial["file_id"] = request.GET["file_id"]
        form = NewBatchForm(owner=request.user, initial=initial)
    context = {"form": form, "preflight": result, "checked": checked,
               "budget": budget_for(request.user) if result is not None else None}
    template = "jobs/batch_new.html"
    if request.htmx:
        template += "#new-batch"
    return render(request, template, context)


# --- the batch page ---


# A batch id as the services make them: only such a `rerun_of` is linked (the metadata is
# the user's to write, and anything else could not be a URL's path segment).
_BATCH_ID = re.compile(r"(?:batch|msgbatch)_[0-9a-f]{24}")


def _detail_context(batch: Batch, tab: str) -> dict[str, Any]:
    rerun_of = (batch.metadata or {}).get("rerun_of")
    return {"batch": batch, "tab": tab, "spot": spot_samples.summary(batch),
            "rerun_of": rerun_of if isinstance(rerun_of, str) and _BATCH_ID.fullmatch(rerun_of)
            else None}


def _blocker(batch: Batch) -> str:
    """Why the batch cannot progress now, in words ("" when it can)."""
    if batch.status == Batch.Status.IN_PROGRESS and not batch.stop_code:
        return queue_health.progress_blocker(batch.model)
    return ""


def _live_head(batch: Batch, user: Any) -> dict[str, Any]:
    """What the live block shows beside the batch row that is cheap to read: the spot-check
    summary, why the batch cannot progress, and what ran it (as `user` may see it: the
    owner, whose staff right is theirs alone). With the row they make its version."""
    blocker = _blocker(batch)
    now = timezone.now()
    projection = batch.projection(now)
    context = {**_detail_context(batch, "overview"), "blocker": blocker,
               "engines": engines_of(batch, user=user), "projection": projection,
               "eta": projection.seconds_left(now)}
    spot = context["spot"]
    # The projection as shown: a waiting batch's end moves on with the clock, but what the
    # page says of it (so long after a worker starts) does not.
    shown = (projection.waits_for, projection.at_risk,
             round(context["eta"] or 0) if projection.waits_for else projection.epoch)
    context["version"] = batch_version(batch, blocker, spot.marked, spot.good, shown)
    return context


def _overview_context(batch: Batch, head: dict[str, Any]) -> dict[str, Any]:
    kinds = _kind_counts(batch)
    return {**head, "stats": dashboard.batch_stats(batch), "flag_counts": flags.flag_counts(batch),
            "cost": _cost(batch), "rerun_offers": _rerun_offers(batch, kinds),
            "to_fix": _to_fix(batch, kinds), "left_out": rerun.left_out_of(batch)}


def _kind_counts(batch: Batch) -> dict[str, int] | None:
    """How many of an ended batch's requests did not succeed, by rerun kind (failed,
    invalid, expired, cancelled): a pass over its error file, cached, made under the owner's
    guard; None while another of their passes runs, {} when there is nothing to count."""
    if not batch.is_ended or batch.status == Batch.Status.FAILED or not batch.failed:
        return {}  # a batch that failed validation ran nothing: its file is to be fixed
    counts: dict[str, int] = {}
    try:
        for code, lines in result_lines.error_counts(
                batch, guard=heavy.one_per_user(batch.owner_id)):
            kind = rerun.kind_of(code)
            counts[kind] = counts.get(kind, 0) + lines
    except heavy.Busy:
        return None
    return counts


def _to_fix(batch: Batch, kinds: dict[str, int] | None) -> dict[str, Any] | None:
    """The download of the lines a rerun leaves out (its invalid requests), with their count
    (None while uncounted); None when there are none."""
    if kinds is None:
        return {"count": None} if batch.failed else None
    count = kinds.get(rerun.INVALID, 0)
    return {"count": count} if count else None


def _rerun_offers(batch: Batch, kinds: dict[str, int] | None) -> list[dict[str, Any]]:
    """The rerun buttons of an ended batch: one per kind of request it holds that may
    succeed if sent again (failed, and expired or cancelled: a batch is stopped one way),
    and both when it holds two; its invalid requests are offered as lines to fix instead
    (`_to_fix`). `kinds`: `_kind_counts` (None: offered without counts)."""
    counts: dict[str, int | None]
    if kinds is None:
        counts = {rerun.FAILED: None}
        if batch.stop_code:
            counts[rerun.kind_of(batch.stop_code)] = None
    else:
        counts = {kind: kinds.get(kind, 0) for kind in rerun.KINDS
                  if kind in rerun.RETRYABLE}
    offers = [{"value": kind, "label": f"{kind} requests", "count": count,
               "id": "rerun" if kind == rerun.FAILED else f"rerun-{kind}"}
              for kind, count in counts.items() if count != 0]
    if len(offers) == 2:
        together = [str(offer["value"]) for offer in offers]
        offers.append({"value": ",".join(together), "label": f"{' and '.join(together)} requests",
                       "count": None if None in counts.values() else sum(
                           c or 0 for c in counts.values()), "id": "rerun-all"})
    return offers


def _cost(batch: Batch) -> dict[str, Any]:
    """The estimate validation priced, then what the ledger has charged so far (it follows
    the shards as they finish, in the transaction that moves the progress version).
    `priced` is false where no price applies to the batch (nothing charged, nothing
    estimated, no price for its model): both then read "not priced" (`format_cost`)."""
    charged = usage.batch_cost(batch.pk)
    currency = charged["currency"]
    priced = bool(charged["cost_nanos"] or batch.cost_ceiling_nanos)
    if not currency or not priced:
        # Before the first charge, the currency of the batch's price (one query).
        rate = rates_for({batch.model}, base_model=batch.model)[batch.model]
        currency = currency or rate.currency
        priced = priced or any((rate.input, rate.cached, rate.output))
    return {"priced": priced,
            "charged": format_cost(charged["cost_nanos"], currency, priced=priced),
            "ceiling": (format_cost(batch.cost_ceiling_nanos, currency)
                        if priced and batch.cost_ceiling_nanos is not None else None),
            "engine_seconds": charged["engine_seconds"]}


@login_required
@require_GET
def batch_detail(request: SignedInRequest, batch_id: str) -> HttpResponse:
    batch = _get_batch_for_user(request, batch_id)
    head = _live_head(batch, request.user)
    return render(request, "jobs/batch_detail.html", {
        **_overview_context(batch, head),
        "poll": _poll(batch, "batch_live", head["version"]),
        "record": batch_record(batch, user=request.user), "reruns": rerun.reruns_of(batch)})


@login_required
@require_GET
def batch_live(request: SignedInRequest, batch_id: str) -> HttpResponse:
    """The live block of the batch page (progress, numbers, report, chart, actions), polled
    every 2 to 30 s (see _poll and static/js/app.js); 286 once the batch has ended, so htmx
    shows the final state and stops.

    While the batch is unchanged a poll that sends back its ETag gets 304 Not Modified (the
    browser shows the copy it has) without the block being computed; a changed batch's block
    is rendered once per version and CSRF secret and then served from the cache."""
    batch = _get_batch_for_user(request, batch_id)
    head = _live_head(batch, request.user)
    if batch.is_ended:
        return HttpResponseStopPolling(render_to_string(
            "jobs/batch_detail.html#live", {**_overview_context(batch, head), "poll": {}},
            request=request))
    poll = _poll(batch, "batch_live", head["version"], request.GET.get("seed", ""))
    # The block holds the cancel form's CSRF token: one copy per CSRF secret (per browser).
    csrf = request.META.get("CSRF_COOKIE") or ""
    now = time.time()
    body_key = hashlib.sha256(repr((head["version"], int(now // LIVE_STALE_SECONDS),
                                    csrf)).encode()).hexdigest()
    etag = '"' + hashlib.sha256(f"{body_key}{poll['url']}".encode()).hexdigest()[:32] + '"'
    response = get_conditional_response(request, etag=etag)
    if response is None:
        cache_key = f"batch-live:{batch.pk}:{body_key}"
        body = cache.get(cache_key) if csrf else None
        if body is None:
            body = render_to_string("jobs/batch_detail.html#live-body",
                                    _overview_context(batch, head), request=request)
            if csrf:
                cache.set(cache_key, body, LIVE_CACHE_SECONDS)
        response = render(request, "jobs/batch_detail.html#live",
                          {**head, "poll": poll, "live_body": mark_safe(body)})
    response["ETag"] = etag
    # Kept by the browser but checked with us on every poll (If-None-Match).
    patch_cache_control(response, private=True, no_cache=True)
    # The same answer while the row is unchanged, until the time-derived figures or the
    # projection are due, and while the queue's verdict on the batch stands.
    remember(response, seconds=min(LIVE_STALE_SECONDS - now % LIVE_STALE_SECONDS,
                                   head["projection"].fresh_for),
                   checks=((functools.partial(_blocker, batch), head["blocker"]),))
    return response


@login_required
def batch_cancel(request: SignedInRequest, batch_id: str) -> HttpResponse:
    """GET: a confirmation page (the no-JavaScript path). POST: cancel."""
    batch = _get_batch_for_user(request, batch_id)
    if request.method == "POST":
        try:
            cancel_batch(batch=batch)
            messages.success(request, "Cancelling: finished results are kept.")
        except ServiceError as exc:
            messages.error(request, exc.message)
        return redirect("batch_detail", batch_id=batch.pk)
    return render(request, "jobs/batch_cancel.html", {"batch": batch})


@login_required
@require_POST
def batch_rerun(request: SignedInRequest, batch_id: str) -> HttpResponse:
    """A new batch of the ended batch's failed, expired or cancelled requests (`requests`:
    one kind, or several joined by commas; failed when not given)."""
    batch = _get_batch_for_user(request, batch_id)
    asked = [kind for kind in request.POST.get("requests", rerun.FAILED).split(",") if kind]
    try:
        kinds = rerun.parse_requests(asked, api=Batch.Api.OPENAI)
        new = rerun.rerun_requests(batch=batch, owner=request.user, kinds=kinds)
    except ServiceError as exc:
        messages.error(request, exc.message)
        return redirect("batch_detail", batch_id=batch.pk)
    said = " and ".join(kind for kind in rerun.KINDS if kind in kinds)
    left_out = rerun.left_out_of(new)
    messages.success(request, f"Rerunning the {said} requests of {batch.pk}." + (
        f" Left out: {left_out} invalid request{'s' if left_out != 1 else ''}, which would "
        "fail the same way (this page links their lines to fix)." if left_out else ""))
    return redirect("batch_detail", batch_id=new.pk)


@login_required
@require_GET
def batch_lines_to_fix(request: SignedInRequest, batch_id: str) -> HttpResponseBase:
    """The input lines of the ended batch's invalid requests, streamed as an attachment:
    what a rerun leaves out, to be fixed and run as a new batch (jobs.services.rerun)."""
    batch = _get_batch_for_user(request, batch_id)
    if not batch.is_ended:
        raise Http404("The batch has not ended.")
    try:
        lines = rerun.lines_to_fix(batch=batch, owner=request.user)
    except ServiceError as exc:  # read in place: its grant revoked
        messages.error(request, exc.message)
        return redirect("batch_detail", batch_id=batch.pk)
    response = StreamingHttpResponse(lines, content_type="application/jsonl")
    response["Content-Disposition"] = f'attachment; filename="{batch.pk}_to_fix.jsonl"'
    return response


DOWNLOAD_KINDS = {"input": None, "output": "output", "errors": "error"}


@login_required
@require_GET
def batch_download(request: SignedInRequest, batch_id: str, kind: str) -> HttpResponseBase:
    """The input, output or error file, streamed as an attachment. While the batch runs,
    output and errors are the finished shards' parts so far."""
    batch = _get_batch_for_user(request, batch_id)
    if kind not in DOWNLOAD_KINDS:
        raise Http404("Unknown download.")
    file_id: str | None
    if kind == "input":
        file_id = batch.input_file_id
    elif batch.is_ended:
        file_id = batch.output_file_id if kind == "output" else batch.error_file_id
    else:
        segs = result_lines.segments(batch, "output" if kind == "output" else "error")
        response = StreamingHttpResponse(result_lines.stream_segments(segs),
                                         content_type="application/jsonl")
        response["Content-Disposition"] = (
            f'attachment; filename="{batch.pk}_{kind}_partial.jsonl"')
        return response
    if not file_id:
        raise Http404("This batch has no such file.")
    try:
        file = get_file_for_user(owner=request.user, file_id=file_id)
    except ServiceError:
        raise Http404("The file was deleted or has expired.") from None
    try:
        return download_response(file)
    except ServiceError as exc:  # read in place: its grant revoked, or its object replaced
        messages.error(request, exc.message)
        return redirect("batch_detail", batch_id=batch.pk)


# --- tabs ---


def _tab(request: SignedInRequest, batch_id: str, kind: result_lines.Kind, tab: str,
         partial: str) -> HttpResponse:
    batch = _get_batch_for_user(request, batch_id)
    filters = ResultFilterForm(request.GET)
    filters.is_valid()
    data = filters.cleaned_data
    context = _detail_context(batch, tab)
    try:
        page = results.read_page(batch, kind, cursor=data.get("cursor") or None,
                                 code=data.get("code") or None, search=data.get("q") or None)
    except ServiceError as exc:
        raise Http404(exc.message) from None
    inputs = results.find_inputs(batch, {r.custom_id for r in page.rows if r.custom_id})
    context.update({
        "page": page, "filters": data,
        "rows": [(row, inputs.get(row.custom_id or "")) for row in page.rows],
        "paged": bool(data.get("cursor")),
    })
    if kind == "error":
        try:
            context["counts"] = result_lines.error_counts(batch, guard=_guard(request))
        except heavy.Busy:
            return _busy(request)
        # A batch that failed validation has no error file: its problems are errors.data.
        context["validation_errors"] = batch.errors or []
    template = f"jobs/batch_{tab}.html"
    if request.htmx and not request.htmx.boosted:
        template += f"#{partial}"
    return render(request, template, context)


@login_required
@require_GET
def batch_errors(request: SignedInRequest, batch_id: str) -> HttpResponse:
    return _tab(request, batch_id, "error", "errors", "error-list")


@login_required
@require_GET
def batch_results(request: SignedInRequest, batch_id: str) -> HttpResponse:
    return _tab(request, batch_id, "output", "results", "result-list")


@login_required
@require_GET
def batch_flags(request: SignedInRequest, batch_id: str) -> HttpResponse:
    """Quality flags: the count of each, and the flagged requests (of one flag with
    ?flag=), each beside its input and output, paged by offset in the flags parts."""
    batch = _get_batch_for_user(request, batch_id)
    flag = request.GET.get("flag") or ""
    if flag and flag not in FLAGS:
        raise Http404("Unknown flag.")
    cursor = request.GET.get("cursor") or None
    try:
        page = flags.read_flag_page(batch, flag=flag or None, cursor=cursor)
    except ServiceError as exc:
        raise Http404(exc.message) from None
    outputs = flags.find_outputs(batch, page.rows)
    inputs = results.find_inputs(batch, {row.custom_id for row in page.rows})
    context = {**_detail_context(batch, "flags"), "flag": flag, "page": page,
               "paged": bool(cursor), "flag_counts": flags.flag_counts(batch),
               "flag_label": FLAG_LABELS.get(flag, ""),
               "rows": [(row, outputs.get(row.custom_id), inputs.get(row.custom_id))
                        for row in page.rows]}
    template = "jobs/batch_flags.html"
    if request.htmx and not request.htmx.boosted:
        template += "#flag-list"
    return render(request, template, context)


@login_required
def batch_spot_check(request: SignedInRequest, batch_id: str) -> HttpResponse:
    """GET: the sample with its marks (?flagged=1: drawn among flagged requests only).
    POST: mark one request (htmx swaps that item)."""
    batch = _get_batch_for_user(request, batch_id)
    flagged = (request.POST if request.method == "POST" else request.GET).get("flagged") == "1"
    if request.method == "POST":
        form = SpotCheckForm(request.POST)
        if not form.is_valid():
            return HttpResponse("Choose good or bad.", status=400)
    try:
        sample = spot_samples.sample(batch, flagged=flagged, guard=_guard(request))
    except heavy.Busy:
        return _busy(request)
    if request.method == "POST":
        try:
            spotcheck.mark(batch=batch, user=request.user,
                           sampled={item.custom_id for item in sample}, **form.cleaned_data)
        except ServiceError as exc:
            return HttpResponse(exc.message, status=400)
        if not request.htmx:
            return redirect(reverse("batch_spot_check", args=[batch.pk]) +
                            ("?flagged=1" if flagged else "") +
                            f"#spot-{slugify(form.cleaned_data['custom_id'])[:60]}")
        # htmx: only the marked item is re-rendered (and the summary, out of band).
        sample = [i for i in sample if i.custom_id == form.cleaned_data["custom_id"]]
    inputs = results.find_inputs(batch, {item.custom_id for item in sample})
    marks = spot_samples.marks(batch)
    items = [{"item": item, "input": inputs.get(item.custom_id),
              "mark": marks.get(item.custom_id)} for item in sample]
    context = {**_detail_context(batch, "spot_check"), "items": items, "flagged": flagged,
               "finished": batch.progress()["completed"]}
    if request.method == "POST":
        return render(request, "jobs/batch_spot_check.html#spot-item",
                      {**context, "entry": items[0], "oob_summary": True})
    return render(request, "jobs/batch_spot_check.html", context)
