"""API keys page: create (the secret is shown once), list, revoke."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_POST

from jobs.http.web import SignedInRequest
from jobs.models import ApiKey
from jobs.services.keys import create_api_key, revoke_api_key
from jobs.views.forms import ApiKeyForm


def _get_key_for_user(request: SignedInRequest, key_id: int) -> ApiKey:
    key = ApiKey.objects.filter(owner=request.user, pk=key_id).first()
    if key is None:
        raise Http404("No such key.")
    return key


@never_cache  # the response to a create carries the secret: no cache may keep it
@login_required
def key_list(request: SignedInRequest) -> HttpResponse:
    secret = None
    if request.method == "POST":
        form = ApiKeyForm(request.POST)
        if form.is_valid():
            # Rendered directly, not redirected: the secret must not travel through the
            # session or a URL, and is never shown again.
            _, secret = create_api_key(owner=request.user, name=form.cleaned_data["name"])
            form = ApiKeyForm()
    else:
        form = ApiKeyForm()
    keys = ApiKey.objects.filter(owner=request.user).order_by("-created_at")
    return render(request, "jobs/key_list.html", {"form": form, "keys": keys,
                                                  "secret": secret})


@login_required
@require_POST
def key_revoke(request: SignedInRequest, key_id: int) -> HttpResponse:
    key = _get_key_for_user(request, key_id)
    revoke_api_key(key=key)
    messages.success(request, f"Revoked {key.name}.")
    return redirect("key_list")
