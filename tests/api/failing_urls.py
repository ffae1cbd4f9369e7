"""A URL configuration whose views fail outside the API's own handling, for the tests of
Django's handler500 (tests/api/test_api_errors.py)."""

from django.http import HttpRequest, HttpResponse
from django.urls import re_path


def _fails(request: HttpRequest) -> HttpResponse:
    raise RuntimeError("a failure no API view caught")


urlpatterns = [re_path(r"^", _fails)]
handler500 = "jobs.api.base.server_error"
