"""/v1/batches"""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet, TextField
from django.db.models.fields.json import KeyTextTransform
from django.db.models.functions import Cast
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.http.response import HttpResponseBase
from django.utils.cache import get_conditional_response, patch_cache_control, set_response_etag

from jobs.api.base import api_view, json_body, paginate, parse_limit
from jobs.http.polls import REMEMBER_SECONDS, remember
from jobs.http.web import LIST_LIMIT, LIST_MAX_LIMIT
from jobs.lib.errors import ServiceError
from jobs.models import Batch
from jobs.queries import results as result_pages
from jobs.services import batches, rerun, stopping


def shown(batch: Batch) -> dict[str, Any]:
    """The batch object as every key sees it: what ran it without the machines' names
    (staff see those in the admin and on the dashboard)."""
    return batch.to_openai()


def create(request: HttpRequest, user: Any) -> HttpResponse:
    body = json_body(request)
    batch = batches.create_batch(
        owner=user, input_file_id=body.get("input_file_id"), endpoint=body.get("endpoint"),
        completion_window=body.get("completion_window"), metadata=body.get("metadata"),
        priority=body.get("priority"), output_expires_after=body.get("output_expires_after"),
        api_key=getattr(request, "api_key", None), strict=body.get("strict", False),
        eval_set=body.get("eval_set"), output_prefix=body.get("output_prefix"))
    return JsonResponse(shown(batches.get_batch_for_user(owner=user, batch_id=batch.pk)))


def list_batches(request: HttpRequest, user: Any) -> HttpResponse:
    """OpenAI's list of the batches made through it, with two filters of our own: `status`
    (one or several, comma separated) and `metadata[KEY]=VALUE` (every one given must
    match). The unfiltered first page, what pollers ask for, comes from a query compiled
    once."""
    objects = _filtered(Batch.objects.filter(owner=user, api=Batch.Api.OPENAI), request)
    filtered = any(k == "status" or k.startswith("metadata[") for k in request.GET)
    newest = None if filtered else (
        lambda count: batches.newest_batches(owner=user, count=count, api=Batch.Api.OPENAI))
    fresh: list[float] = []

    def shown_on_page(batch: Batch) -> dict[str, Any]:
        fresh.append(batch.projection().fresh_for)
        return shown(batch)

    response = paginate(request, objects, default_limit=LIST_LIMIT,
                        max_limit=LIST_MAX_LIMIT, newest=newest, shown=shown_on_page)
    # The first page is replayed, while its batches are unchanged, to this client's next
    # polls (jobs.http.polls takes only that page), while their projections hold.
    remember(response, seconds=min(fresh, default=REMEMBER_SECONDS))
    return response


def _filtered(objects: QuerySet[Batch], request: HttpRequest) -> QuerySet[Batch]:
    if statuses := request.GET.get("status"):
        wanted = statuses.split(",")
        if unknown := sorted(set(wanted) - set(Batch.Status.values)):
            raise ServiceError(f"Unknown batch status {unknown[0]!r}; one of: "
                               f"{', '.join(Batch.Status.values)}.", param="status")
        objects = objects.filter(status__in=wanted)
    for number, (name, value) in enumerate(request.GET.items()):
        if name.startswith("metadata[") and name.endswith("]"):
            # The key is taken literally (never as a lookup path), matched as text.
            alias = f"metadata_{number}"
            text = Cast(KeyTextTransform(name[9:-1], "metadata"), TextField())
            objects = objects.alias(**{alias: text}).filter(**{alias: value})
    return objects


def retrieve(request: HttpRequest, user: Any, batch_id: str) -> HttpResponse:
    """The batch; a poller that sends back the ETag of its last answer gets 304 Not Modified
    (no body) while nothing it shows changed. The ETag is the body's hash, so it covers
    every field shown, counters and status alike."""
    batch = batches.get_openai_batch_for_user(owner=user, batch_id=batch_id)
    response = JsonResponse(shown(batch))
    set_response_etag(response)
    # Revalidated on every use (a shared cache must never keep one owner's batch).
    patch_cache_control(response, private=True, no_cache=True)
    answer = get_conditional_response(request, etag=response["ETag"], response=response)
    # Replayed, while the batch row is unchanged, to this client's next polls (jobs.http.polls),
    # until its projected end would be past or its at-risk flag due (Batch.projection).
    remember(answer or response, seconds=batch.projection().fresh_for)
    return answer or response


def results(request: HttpRequest, user: Any, batch_id: str) -> HttpResponseBase:
    """An extension: the results finished so far, before the batch ends and after, as
    JSONL lines in the output-file format (see jobs.queries.results.results_page). The
    headers say whether the batch has ended, whether more lines are there now, and where
    the next page starts."""
    batch = batches.get_openai_batch_for_user(owner=user, batch_id=batch_id)
    status = request.GET.get("status")
    if status not in (None, "", *result_pages.STATUSES):
        raise ServiceError("status must be 'succeeded' or 'failed'.", param="status")
    page = result_pages.results_page(
        batch, statuses=(status,) if status else tuple(result_pages.STATUSES),
        custom_id=request.GET.get("custom_id") or None, after=request.GET.get("after"),
        limit=parse_limit(request.GET.get("limit"), default=100, maximum=1000))
    response = StreamingHttpResponse(iter(page.lines), content_type="application/jsonl")
    response["X-Batch-Ended"] = "true" if page.ended else "false"
    response["X-Has-More"] = "true" if page.has_more else "false"
    response["X-Next-After"] = page.after
    if page.restarted:
        response["X-Results-Restarted"] = "true"
    patch_cache_control(response, private=True, no_store=True)
    return response


def cancel(request: HttpRequest, user: Any, batch_id: str) -> HttpResponse:
    batch = batches.get_openai_batch_for_user(owner=user, batch_id=batch_id)
    return JsonResponse(shown(stopping.cancel_batch(batch=batch)))


def rerun_batch(request: HttpRequest, user: Any, batch_id: str) -> HttpResponse:
    """An extension: a new batch of the ended batch's requests that did not succeed (the
    body's `requests`: failed, expired, cancelled, invalid or both; without it, every one
    that may succeed if sent again), made as any batch is (jobs.services.rerun)."""
    batch = batches.get_openai_batch_for_user(owner=user, batch_id=batch_id)
    body = json_body(request) if request.body else {}
    new = rerun.rerun_requests(
        batch=batch, owner=user, kinds=rerun.parse_requests(body.get("requests"), api=batch.api),
        api_key=getattr(request, "api_key", None))
    return JsonResponse(shown(batches.get_batch_for_user(owner=user, batch_id=new.pk)))


batch_list = api_view({"GET": list_batches, "POST": create})
batch_detail = api_view({"GET": retrieve})
batch_cancel = api_view({"POST": cancel})
batch_results = api_view({"GET": results})
batch_rerun = api_view({"POST": rerun_batch})
