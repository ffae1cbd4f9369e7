"""/v1/eval_sets: an extension. Users create their own eval sets from a file they uploaded
(purpose batch), list theirs beside the operator's, and delete their own; the rules and
runs are jobs.services.evals' (docs/eval-sets.md)."""

from __future__ import annotations

from typing import Any

from django.db.models import F
from django.http import HttpRequest, HttpResponse, JsonResponse

from jobs.api.base import api_view, json_body
from jobs.models import EvalSet, epoch
from jobs.services import evals

# The fields of the create body (besides name, file_id and rule): the rule's options.
OPTIONS = ("tolerance", "embedding_model", "similarity", "drift_threshold")


def shown(eval_set: EvalSet) -> dict[str, Any]:
    """An eval set as the API shows it: `owned_by` says whose it is (the user's own, which
    they may delete, or the operator's, offered to every user)."""
    return {
        "id": evals.public_id(eval_set),
        "object": "eval_set",
        "name": eval_set.name,
        "owned_by": "operator" if eval_set.owner_id is None else "user",
        "created_at": epoch(eval_set.created_at),
        "url": eval_set.url,
        "items": eval_set.item_count,
        "bytes": eval_set.bytes,
        "sha256": eval_set.sha256,
        "rule": eval_set.rule,
        "tolerance": eval_set.tolerance,
        "embedding_model": eval_set.embedding_model or None,
        "similarity": eval_set.similarity,
        "drift_threshold": eval_set.drift_threshold,
    }


def create(request: HttpRequest, user: Any) -> HttpResponse:
    body = json_body(request)
    eval_set = evals.create_eval_set_from_file(
        owner=user, file_id=body.get("file_id"), name=body.get("name"), rule=body.get("rule"),
        **{option: body.get(option) for option in OPTIONS})
    return JsonResponse(shown(eval_set))


def list_sets(request: HttpRequest, user: Any) -> HttpResponse:
    """Every set the user may attach, newest first: a user keeps at most
    evals.MAX_OWN_SETS and the operator's are few, so the list is one page."""
    data = [shown(s) for s in evals.sets_for(user).order_by(F("created_at").desc(), "-pk")]
    return JsonResponse({"object": "list", "data": data,
                         "first_id": data[0]["id"] if data else None,
                         "last_id": data[-1]["id"] if data else None, "has_more": False})


def retrieve(request: HttpRequest, user: Any, set_id: str) -> HttpResponse:
    return JsonResponse(shown(evals.get_eval_set_for_user(owner=user, id_or_name=set_id)))


def delete(request: HttpRequest, user: Any, set_id: str) -> HttpResponse:
    eval_set = evals.get_eval_set_for_user(owner=user, id_or_name=set_id)
    evals.delete_eval_set(eval_set=eval_set, user=user)
    return JsonResponse({"id": evals.public_id(eval_set), "object": "eval_set",
                         "deleted": True})


eval_set_list = api_view({"GET": list_sets, "POST": create})
eval_set_detail = api_view({"GET": retrieve, "DELETE": delete})
