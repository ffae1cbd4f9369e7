"""/v1/batches and /v1/models"""

from __future__ import annotations

import time
from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils.cache import get_conditional_response, patch_cache_control, set_response_etag

from jobs.api.base import api_view, json_body, paginate
from jobs.engines import model_names
from jobs.models import Batch
from jobs.services import batches, stopping


def create(request: HttpRequest, user: Any) -> HttpResponse:
    body = json_body(request)
    batch = batches.create_batch(
        owner=user, input_file_id=body.get("input_file_id"), endpoint=body.get("endpoint"),
        completion_window=body.get("completion_window"), metadata=body.get("metadata"),
        priority=body.get("priority"), output_expires_after=body.get("output_expires_after"))
    return JsonResponse(batches.get_batch_for_user(owner=user, batch_id=batch.pk).to_openai())


def list_batches(request: HttpRequest, user: Any) -> HttpResponse:
    objects = Batch.objects.filter(owner=user)
    return paginate(request, objects, default_limit=20, max_limit=100,
                    newest=lambda count: batches.newest_batches(owner=user, count=count))


def retrieve(request: HttpRequest, user: Any, batch_id: str) -> HttpResponse:
    """The batch; a poller that sends back the ETag of its last answer gets 304 Not Modified
    (no body) while nothing it shows changed. The ETag is the body's hash, so it covers
    every field shown, counters and status alike."""
    response = JsonResponse(batches.get_batch_for_user(owner=user, batch_id=batch_id)
                            .to_openai())
    set_response_etag(response)
    # Revalidated on every use (a shared cache must never keep one owner's batch).
    patch_cache_control(response, private=True, no_cache=True)
    return get_conditional_response(request, etag=response["ETag"], response=response) or response


def cancel(request: HttpRequest, user: Any, batch_id: str) -> HttpResponse:
    batch = batches.get_batch_for_user(owner=user, batch_id=batch_id)
    return JsonResponse(stopping.cancel_batch(batch=batch).to_openai())


def list_models(request: HttpRequest, user: Any) -> HttpResponse:
    created = int(time.time())
    return JsonResponse({"object": "list", "data": [
        {"id": name, "object": "model", "created": created, "owned_by": "batchweb"}
        for name in model_names()]})


batch_list = api_view({"GET": list_batches, "POST": create})
batch_detail = api_view({"GET": retrieve})
batch_cancel = api_view({"POST": cancel})
models = api_view({"GET": list_models})
