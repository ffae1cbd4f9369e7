"""What every /v1 view shares: key auth and error objects (OpenAI's and Anthropic's), JSON
bodies, lists."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.core.files.uploadedfile import UploadedFile
from django.db.models import Model, Q, QuerySet
from django.http import HttpRequest, JsonResponse
from django.http.multipartparser import MultiPartParserError
from django.http.response import HttpResponseBase
from django.views import defaults
from django.views.decorators.csrf import csrf_exempt

from engine.endpoints import anthropic_error
from jobs.http.web import API_PREFIX, declared_length
from jobs.lib.errors import ServiceError
from jobs.services.keys import authenticate_key

log = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
}


def api_error(status: int, message: str, *, code: str | None = None,
              param: str | None = None, type: str | None = None) -> JsonResponse:
    """An OpenAI error object: {"error": {"message", "type", "param", "code"}}."""
    return JsonResponse({"error": {"message": message,
                                   "type": type or ERROR_TYPES.get(status, "invalid_request_error"),
                                   "param": param, "code": code}}, status=status)


Handler = Callable[..., HttpResponseBase]


@dataclass(frozen=True)
class Dialect:
    """How an API carries its key and shows a refusal: the one error mapper below serves
    OpenAI's API and Anthropic's alike."""

    # The API key the request carries, if any.
    secret: Callable[[HttpRequest], str | None]
    missing_key: str
    # A ServiceError (or the mapper's own 401 / 405 / 500) as this API's error object.
    render: Callable[[ServiceError], JsonResponse]


def _bearer(request: HttpRequest) -> str | None:
    scheme, _, secret = request.headers.get("Authorization", "").partition(" ")
    return secret.strip() if scheme.lower() == "bearer" else None


def _openai_error(exc: ServiceError) -> JsonResponse:
    return api_error(exc.status, exc.message, code=exc.code, param=exc.param, type=exc.type)


def _anthropic_error(exc: ServiceError) -> JsonResponse:
    # Anthropic documents no 409, and its client retries one: a refusal of the batch's
    # state (cancel or delete at the wrong time) is its invalid request, a 400.
    status = 400 if exc.status == 409 else exc.status
    return JsonResponse(anthropic_error(status, exc.message), status=status)


OPENAI = Dialect(secret=_bearer, render=_openai_error,
                 missing_key="Incorrect or missing API key. Send 'Authorization: Bearer "
                             "<key>' with a key from the dashboard.")
# Anthropic's API takes its key as x-api-key (with an anthropic-version header, whose value
# changes nothing here); its client sends an API key as `Authorization: Bearer` in recent
# versions, which is taken too. The same keys as the OpenAI API.
ANTHROPIC = Dialect(secret=lambda request: request.headers.get("x-api-key") or _bearer(request),
                    render=_anthropic_error,
                    missing_key="Incorrect or missing API key. Send 'x-api-key: <key>' with "
                                "a key from the dashboard.")


# Where each API's paths are: everything under /v1/ is answered in an API's error shape,
# Anthropic's under its Message Batches paths (/v1/messages...), OpenAI's elsewhere.
ANTHROPIC_PATHS = "/v1/messages"


def dialect_of(path: str) -> Dialect | None:
    """The API a request path belongs to, None outside /v1/ (the dashboard's pages)."""
    if path == ANTHROPIC_PATHS or path.startswith(ANTHROPIC_PATHS + "/"):
        return ANTHROPIC
    return OPENAI if path.startswith(API_PREFIX) else None


@csrf_exempt
def unknown_path(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
    """Any path under /v1/ that no route serves: the API's 404 (as OpenAI's "Invalid URL"),
    never Django's HTML page, whatever the method or key."""
    dialect = dialect_of(request.path) or OPENAI
    return dialect.render(ServiceError(f"Invalid URL ({request.method} {request.path})",
                                       status=404))


def server_error(request: HttpRequest) -> HttpResponseBase:
    """Django's handler500: under /v1/ the API's 500 (an error raised outside an API view,
    in a middleware), Django's page elsewhere."""
    dialect = dialect_of(request.path)
    if dialect is None:
        return defaults.server_error(request)
    return dialect.render(ServiceError("The server failed to handle the request.",
                                       status=500, code="server_error", type="server_error"))


def bad_request(request: HttpRequest, exception: Exception) -> HttpResponseBase:
    """Django's handler400 (a request Django refuses before any view: a host not allowed,
    a malformed body), in the API's shape under /v1/."""
    dialect = dialect_of(request.path)
    if dialect is None:
        return defaults.bad_request(request, exception)
    return dialect.render(ServiceError("The request could not be handled: it is malformed "
                                       "or sent to a host this service does not answer."))


def api_view(methods: dict[str, Handler], *, dialect: Dialect = OPENAI) -> Handler:
    """One URL, a handler per HTTP method, each called with the authenticated user.

    Missing or bad keys are a 401, service refusals their own status, anything unexpected
    a 500 in the same shape (and logged) so clients always get the API's error object.
    """

    @csrf_exempt
    def view(request: HttpRequest, **kwargs: Any) -> HttpResponseBase:
        handler = methods.get(request.method or "")
        secret = dialect.secret(request)
        key = authenticate_key(secret.strip()) if secret else None
        if key is None:
            return dialect.render(ServiceError(dialect.missing_key, status=401,
                                               code="invalid_api_key",
                                               type="authentication_error"))
        if handler is None:
            return dialect.render(ServiceError(f"Method {request.method} is not allowed here.",
                                               status=405, code="method_not_allowed"))
        request.user = key.owner
        request.api_key = key  # type: ignore[attr-defined]  # charged in the usage ledger
        try:
            return handler(request, key.owner, **kwargs)
        except ServiceError as exc:
            return dialect.render(exc)
        except Exception:
            log.exception("API error on %s %s", request.method, request.path)
            return dialect.render(ServiceError("The server failed to handle the request.",
                                               status=500, code="server_error",
                                               type="server_error"))

    return view


def json_body(request: HttpRequest) -> dict[str, Any]:
    content_type = request.content_type or ""
    if content_type != "application/json":
        raise ServiceError("Send the request body as JSON with Content-Type: application/json.")
    try:
        body = json.loads(request.body or b"{}")
    except (ValueError, RecursionError):
        raise ServiceError("The request body is not valid JSON.") from None
    if not isinstance(body, dict):
        raise ServiceError("The request body must be a JSON object.")
    return body


def check_upload_size(request: HttpRequest, limit: int) -> None:
    """Refuse a too-large body from its Content-Length, before reading any of it."""
    length = declared_length(request)
    # Multipart framing adds a little; the file itself is checked again once received.
    if length > limit + 64 * 1024:
        raise ServiceError(f"The upload is larger than {limit} bytes.", status=413,
                           code="file_too_large", param="file")


def multipart_file(request: HttpRequest, field: str) -> UploadedFile:
    if not (request.content_type or "").startswith("multipart/form-data"):
        raise ServiceError("Send the file as multipart/form-data.", param=field)
    try:
        uploaded = request.FILES.get(field)
    except MultiPartParserError as exc:  # e.g. a part's headers over Django's 1 kB limit
        raise ServiceError(f"The multipart body could not be read: {exc}", param=field) from None
    if uploaded is None:
        raise ServiceError(f"Missing the '{field}' file field.", param=field)
    return uploaded


def parse_limit(value: str | None, *, default: int, maximum: int) -> int:
    if value in (None, ""):
        return default
    try:
        limit = int(value)
    except ValueError:
        raise ServiceError("limit must be an integer.", param="limit") from None
    if not 1 <= limit <= maximum:
        raise ServiceError(f"limit must be between 1 and {maximum}.", param="limit")
    return limit


def paginate(request: HttpRequest, objects: QuerySet[Any], *, default_limit: int,
             max_limit: int, allow_order: bool = False,
             newest: Callable[[int], list[Any]] | None = None,
             shown: Callable[[Any], dict[str, Any]] | None = None) -> JsonResponse:
    """OpenAI's cursor lists: {object: list, data, first_id, last_id, has_more}, newest
    first (or `order=asc`), continuing `after` the given id. `newest(n)`, when given, is the
    first n objects newest first (the first page, which clients poll) from a cheaper query.
    `shown(obj)` is an object as the list shows it (default: its `to_openai()`)."""
    limit = parse_limit(request.GET.get("limit"), default=default_limit, maximum=max_limit)
    order = request.GET.get("order", "desc") if allow_order else "desc"
    if order not in ("asc", "desc"):
        raise ServiceError("order must be 'asc' or 'desc'.", param="order")
    after = request.GET.get("after")
    if order == "asc":
        objects = objects.order_by("created_at", "pk")
    else:
        objects = objects.order_by("-created_at", "-pk")
    if after:
        anchor: Model | None = objects.filter(pk=after).first() if "\x00" not in after else None
        if anchor is None:
            raise ServiceError("after must be the id of an object in this list.", param="after")
        stamp = anchor.created_at  # type: ignore[attr-defined]
        if order == "asc":
            objects = objects.filter(Q(created_at__gt=stamp) | Q(created_at=stamp, pk__gt=after))
        else:
            objects = objects.filter(Q(created_at__lt=stamp) | Q(created_at=stamp, pk__lt=after))
    if newest is not None and not after and order == "desc":
        page = newest(limit + 1)
    else:
        page = list(objects[: limit + 1])
    has_more = len(page) > limit
    data = [shown(obj) if shown else obj.to_openai() for obj in page[:limit]]
    return JsonResponse({"object": "list", "data": data,
                         "first_id": data[0]["id"] if data else None,
                         "last_id": data[-1]["id"] if data else None, "has_more": has_more})


def max_file_bytes() -> int:
    return settings.BATCHWEB["MAX_FILE_BYTES"]
