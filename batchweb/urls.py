from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("", include("jobs.views.ops_urls")),  # /metrics, /account/
    path("v1/", include("jobs.api.urls")),
    path("admin/rq/", include("django_rq.urls")),
    path("admin/", admin.site.urls),
    path("", include("jobs.views.urls")),
]
