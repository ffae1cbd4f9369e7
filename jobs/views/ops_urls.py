"""Operations URLs: the Prometheus endpoint and the user's account page (usage, limits,
webhook)."""

from django.urls import path

from jobs.http.metrics import metrics_view
from jobs.views import account

urlpatterns = [
    path("metrics", metrics_view, name="metrics"),
    path("account/", account.account, name="account"),
    path("account/webhook-secret", account.rotate_webhook_secret, name="rotate_webhook_secret"),
]
