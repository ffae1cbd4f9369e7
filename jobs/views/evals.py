"""Eval sets on the dashboard: a user's own sets (list beside the operator's, upload one,
delete one) and the eval runs of the batch page (accepting one as its set's baseline)."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.db.models import F
from django.http import Http404, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from jobs.http.web import SignedInRequest, uploaded_path
from jobs.lib.errors import ServiceError
from jobs.models import EvalRun, EvalSet
from jobs.services import evals
from jobs.services.batches import get_batch_for_user
from jobs.views.forms import EvalSetForm


def _get_eval_set_for_user(request: SignedInRequest, set_id: int) -> EvalSet:
    """One of the user's own sets, or 404: another user's looks like one that does not
    exist, and the operator's are not the user's to change."""
    found = EvalSet.objects.filter(owner=request.user, pk=set_id).first()
    if found is None:
        raise Http404("No such eval set.")
    return found


@login_required
def eval_set_list(request: SignedInRequest) -> HttpResponse:
    """GET: the user's own sets and the operator's. POST: upload a new one (checked line
    by line by the service: a bad line is shown with its number and nothing is stored)."""
    form = EvalSetForm(request.POST or None, request.FILES or None)
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        with uploaded_path(data["upload"]) as path:
            try:
                created = evals.create_own_eval_set(
                    owner=request.user, name=data["name"], path=path, rule=data["rule"],
                    tolerance=data.get("tolerance"),
                    embedding_model=data.get("embedding_model") or None,
                    similarity=data.get("similarity"),
                    drift_threshold=data.get("drift_threshold"))
            except ServiceError as exc:
                # A field's own problem beside it; a line's (whatever it names) beside the
                # file; a limit (sets, stored bytes, one at a time) above the form.
                field = (exc.param if exc.param in form.fields else
                         "upload" if exc.param else None)
                form.add_error(field, exc.message)
            else:
                messages.success(request, f"Created the eval set {created.name} "
                                          f"({created.item_count} items).")
                return redirect("eval_set_list")
    sets = evals.sets_for(request.user).order_by(F("owner_id").asc(nulls_last=True), "name")
    return render(request, "jobs/eval_set_list.html", {"form": form, "sets": sets,
                                                       "limit": evals.MAX_OWN_SETS})


@login_required
@require_POST
def eval_set_delete(request: SignedInRequest, set_id: int) -> HttpResponse:
    eval_set = _get_eval_set_for_user(request, set_id)
    try:
        evals.delete_eval_set(eval_set=eval_set, user=request.user)
        messages.success(request, f"Deleted the eval set {eval_set.name}.")
    except ServiceError as exc:
        messages.error(request, exc.message)
    return redirect("eval_set_list")


@login_required
@require_POST
def eval_run_accept(request: SignedInRequest, batch_id: str, run_id: str) -> HttpResponse:
    """Make the run the baseline later runs of its set on its model are compared with."""
    try:
        batch = get_batch_for_user(owner=request.user, batch_id=batch_id)
    except ServiceError:
        raise Http404("No such batch.") from None
    run = EvalRun.objects.select_related("eval_set").filter(pk=run_id, batch=batch).first()
    if run is None:
        raise Http404("No such eval run.")
    try:
        evals.accept_run(run=run, user=request.user)
        messages.success(request, f"Run {run.pk} is now the baseline of "
                                  f"{run.eval_set.name} on {run.base_model}.")
    except ServiceError as exc:
        messages.error(request, exc.message)
    return redirect("batch_detail", batch_id=batch.pk)
