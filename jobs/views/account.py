"""Account page: the user's usage against their quota, and their webhook (URL, signing
secret, recent deliveries)."""

from __future__ import annotations

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_POST

from jobs.http.web import SignedInRequest
from jobs.lib.errors import ServiceError
from jobs.models import WebhookEvent
from jobs.services import quotas, webhooks
from jobs.services.budgets import budget_for


class WebhookForm(forms.Form):
    webhook_url = forms.URLField(required=False, max_length=500, assume_scheme="https",
                                 label="Webhook URL",
                                 help_text="Leave empty to receive no notifications.")


@never_cache  # the page shows the signing secret
@login_required
def account(request: SignedInRequest) -> HttpResponse:
    user_settings = webhooks.settings_for(request.user)
    if request.method == "POST":
        form = WebhookForm(request.POST)
        if form.is_valid():
            try:
                webhooks.set_webhook_url(user=request.user,
                                         url=form.cleaned_data["webhook_url"])
                messages.success(request, "Webhook saved." if form.cleaned_data["webhook_url"]
                                 else "Webhook removed.")
                return redirect("account")
            except ServiceError as exc:
                form.add_error("webhook_url", exc.message)
    else:
        form = WebhookForm(initial={"webhook_url": user_settings.webhook_url})
    events = WebhookEvent.objects.filter(owner=request.user).order_by("-created_at")[:10]
    return render(request, "jobs/account.html", {
        # The cost row's money as every page shows it (with its currency, or not priced).
        "quota_rows": quotas.summary(request.user), "budget": budget_for(request.user),
        "form": form,
        "user_settings": user_settings, "events": events})


@login_required
@require_POST
def rotate_webhook_secret(request: SignedInRequest) -> HttpResponse:
    webhooks.rotate_secret(user=request.user)
    messages.success(request, "New signing secret created; the old one no longer verifies.")
    return redirect("account")
