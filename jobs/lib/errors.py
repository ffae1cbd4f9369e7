"""What a refused request looks like (ServiceError) and its common kinds, shared by the
services that refuse and the reads that refuse a bad cursor alike."""

from __future__ import annotations


class ServiceError(Exception):
    """A request the service refuses, with what the user needs to fix it.

    The API renders it as an OpenAI error object with `status`; pages show `message`.
    """

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        code: str | None = None,
        param: str | None = None,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code
        self.param = param
        self.type = type


def storable_id(value: object) -> bool:
    """Whether a client-sent id can be looked up at all: PostgreSQL text cannot hold NUL,
    and the query would fail (a 500) instead of finding nothing (a 404)."""
    return isinstance(value, str) and "\x00" not in value


def not_found(what: str, object_id: str) -> ServiceError:
    # The same answer whether the object does not exist or belongs to someone else.
    return ServiceError(f"No such {what}: '{object_id}'", status=404, code="not_found",
                        type="invalid_request_error")


def wrong_state(message: str) -> ServiceError:
    return ServiceError(message, status=409, code="invalid_state")
