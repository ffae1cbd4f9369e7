"""/v1/models: the models a batch's requests may name, LoRA adapters included."""

from __future__ import annotations

import time
from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse

from jobs.api.base import api_view
from jobs.lib.model_registry import model_names
from jobs.models import LoraAdapter


def list_models(request: HttpRequest, user: Any) -> HttpResponse:
    created = int(time.time())
    # LoRA adapters are models a request can name too; `parent` (vLLM's field) says which
    # model they run on.
    return JsonResponse({"object": "list", "data": [
        {"id": name, "object": "model", "created": created, "owned_by": "batchweb"}
        for name in model_names()] + [
        {"id": name, "object": "model", "created": created, "owned_by": "batchweb",
         "parent": base} for name, base in sorted(LoraAdapter.objects.usable().items())]})


models = api_view({"GET": list_models})
