"""/v1/messages/batches: Anthropic's Message Batches API, with its keys (x-api-key) and
error objects. The batches are ours (jobs/services/message_batches.py); what they look
like here is jobs/formats/anthropic.py."""

from __future__ import annotations

from typing import Any

from django.db.models import Q
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.http.response import HttpResponseBase
from django.utils.cache import patch_cache_control

from jobs.api.base import ANTHROPIC, api_view, json_body, parse_limit
from jobs.formats import anthropic
from jobs.http.web import declared_length
from jobs.lib import heavy
from jobs.lib.errors import ServiceError, storable_id
from jobs.models import Batch
from jobs.services import rerun, stopping
from jobs.services.batches import get_message_batch_for_user
from jobs.services.message_batches import create_message_batch, delete_message_batch


def _shown(request: HttpRequest, batch: Batch) -> dict[str, Any]:
    # A stopped batch's counts are a pass over its error file (cached once counted): made
    # under the per-user guard of the dashboard's heavy views, so that one user's requests
    # cannot keep every web process counting.
    try:
        shape = anthropic.message_batch(batch, base_url=request.build_absolute_uri("/"),
                                        guard=heavy.one_per_user(batch.owner_id))
    except heavy.Busy:
        raise ServiceError("Another of your requests is counting a batch's results; retry "
                           "in a moment.", status=429, code="rate_limit_exceeded") from None
    # Extensions: the batch this one reruns, and how many invalid requests of it the rerun
    # left out (a Message Batch has no metadata to carry them, as an OpenAI batch's does).
    return {**shape, "rerun_of": (batch.metadata or {}).get("rerun_of"),
            "rerun_left_out": rerun.left_out_of(batch)}


def create(request: HttpRequest, user: Any) -> HttpResponse:
    if request.content_type != "application/json":
        raise ServiceError("Send the request body as JSON with Content-Type: application/json.")
    batch = create_message_batch(owner=user, body=request,  # read as a stream
                                 declared_length=declared_length(request),
                                 api_key=getattr(request, "api_key", None))
    return JsonResponse(_shown(request, batch))


def list_batches(request: HttpRequest, user: Any) -> HttpResponse:
    """Anthropic's paging: newest first, `after_id` the page after (older than) that batch,
    `before_id` the page just before (newer than) it; first_id / last_id / has_more."""
    limit = parse_limit(request.GET.get("limit"), default=20, maximum=1000)
    after, before = request.GET.get("after_id"), request.GET.get("before_id")
    if after and before:
        raise ServiceError("Give after_id or before_id, not both.", param="before_id")
    batches = Batch.objects.filter(owner=user, api=Batch.Api.ANTHROPIC)
    cursor = after or before
    if cursor:
        anchor = batches.filter(pk=cursor).first() if storable_id(cursor) else None
        if anchor is None:
            raise ServiceError(f"{'after_id' if after else 'before_id'} must be the id of a "
                               "message batch in this list.",
                               param="after_id" if after else "before_id")
        stamp = anchor.created_at
        if after:
            batches = batches.filter(Q(created_at__lt=stamp) | Q(created_at=stamp, pk__lt=cursor))
        else:
            batches = batches.filter(Q(created_at__gt=stamp) | Q(created_at=stamp, pk__gt=cursor))
    if before:  # the `limit` nearest the anchor, then shown newest first
        page = list(batches.order_by("created_at", "pk")[: limit + 1])
        has_more = len(page) > limit
        page = page[:limit][::-1]
    else:
        page = list(batches.order_by("-created_at", "-pk")[: limit + 1])
        has_more = len(page) > limit
        page = page[:limit]
    data = [_shown(request, batch) for batch in page]
    return JsonResponse({"data": data, "has_more": has_more,
                         "first_id": data[0]["id"] if data else None,
                         "last_id": data[-1]["id"] if data else None})


def retrieve(request: HttpRequest, user: Any, batch_id: str) -> HttpResponse:
    return JsonResponse(_shown(request, get_message_batch_for_user(owner=user,
                                                                   batch_id=batch_id)))


def delete(request: HttpRequest, user: Any, batch_id: str) -> HttpResponse:
    batch = get_message_batch_for_user(owner=user, batch_id=batch_id)
    delete_message_batch(batch=batch)
    return JsonResponse({"id": batch_id, "type": "message_batch_deleted"})


def cancel(request: HttpRequest, user: Any, batch_id: str) -> HttpResponse:
    batch = get_message_batch_for_user(owner=user, batch_id=batch_id)
    return JsonResponse(_shown(request, stopping.cancel_batch(batch=batch)))


def rerun_batch(request: HttpRequest, user: Any, batch_id: str) -> HttpResponse:
    """An extension: a new Message Batch of the ended batch's requests that did not succeed
    (the body's `requests`: errored, expired, canceled, invalid or both; without it, every
    one that may succeed if sent again), made as any batch is (jobs.services.rerun)."""
    batch = get_message_batch_for_user(owner=user, batch_id=batch_id)
    body = json_body(request) if request.body else {}
    new = rerun.rerun_requests(
        batch=batch, owner=user, kinds=rerun.parse_requests(body.get("requests"), api=batch.api),
        api_key=getattr(request, "api_key", None))
    return JsonResponse(_shown(request, new))


def results(request: HttpRequest, user: Any, batch_id: str) -> HttpResponseBase:
    """The results file: one JSON line per request, once the batch has ended."""
    batch = get_message_batch_for_user(owner=user, batch_id=batch_id)
    if not batch.is_ended:
        raise ServiceError(f"The results of {batch_id} are available once it has ended; it "
                           f"is {anthropic.PROCESSING_STATUS[Batch.Status(batch.status)]}.")
    anthropic.check_results_kept(batch)
    response = StreamingHttpResponse(anthropic.results(batch),
                                     content_type="application/x-jsonl")
    patch_cache_control(response, private=True, no_store=True)
    return response


batch_list = api_view({"GET": list_batches, "POST": create}, dialect=ANTHROPIC)
batch_detail = api_view({"GET": retrieve, "DELETE": delete}, dialect=ANTHROPIC)
batch_cancel = api_view({"POST": cancel}, dialect=ANTHROPIC)
batch_results = api_view({"GET": results}, dialect=ANTHROPIC)
batch_rerun = api_view({"POST": rerun_batch}, dialect=ANTHROPIC)
