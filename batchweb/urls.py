from collections.abc import Callable

from django.contrib import admin
from django.contrib.auth.decorators import user_passes_test
from django.urls import include, path, re_path
from django_rq.urls import get_admin_urlpatterns, get_api_urlpatterns

from jobs.api.base import unknown_path

# django-rq's pages show every job's arguments and can empty, requeue or stop any queue:
# superusers only (django-rq itself lets any staff user in). Everyone else is sent to the
# admin's login, which tells a signed-in staff user they may not see the page. stats.json
# keeps django-rq's own check (staff, or RQ_API_TOKEN): counts only, as on Queue health.
superuser_required: Callable[[Callable], Callable] = user_passes_test(
    lambda user: user.is_superuser, login_url="admin:login")
rq_urlpatterns = [*get_api_urlpatterns(),
                  *get_admin_urlpatterns(view_wrapper=superuser_required)]

# Each app's admin module, registered here rather than when Django starts
# (batchweb.apps.AdminConfig): only a process that serves pages loads them.
admin.autodiscover()

urlpatterns = [
    path("", include("jobs.views.ops_urls")),  # /metrics, /account/
    path("v1/", include("jobs.api.urls")),
    # Any other path under /v1/, and /v1 itself: the API's 404, not Django's page (with
    # DEBUG on too), nor APPEND_SLASH's redirect of /v1 to /v1/ (an HTML answer).
    re_path(r"^v1(?:/|$)", unknown_path),
    path("admin/rq/", include((rq_urlpatterns, "django_rq"))),
    path("admin/", admin.site.urls),
    path("", include("jobs.views.urls")),
]

# Errors Django answers itself, outside any view, are the API's JSON under /v1/.
handler400 = "jobs.api.base.bad_request"
handler500 = "jobs.api.base.server_error"
