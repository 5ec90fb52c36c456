"""The one place that turns errors into ``application/problem+json``: domain errors (``DomainError`` from any
room) by their kind, DRF's own exceptions by class, and the API's own ``Problem``s (which carry a status).
"""

from __future__ import annotations

import logging
from typing import Any

import redis
from django import db
from django.http import Http404
from rest_framework import exceptions as drf_exceptions
from rest_framework.response import Response

from budgeting.catalog.errors import (
    CapacityExhausted,
    Conflict,
    DomainError,
    InvalidInput,
    NotFound,
    Unavailable,
    Unprocessable,
)

PROBLEM_CONTENT_TYPE = "application/problem+json"

logger = logging.getLogger(__name__)

# The first kind in a domain error's class hierarchy that is listed here gives its status.
STATUS_BY_KIND: dict[type[DomainError], int] = {
    InvalidInput: 400,
    NotFound: 404,
    Conflict: 409,
    Unprocessable: 422,
    CapacityExhausted: 429,
    Unavailable: 503,
}


class Problem(DomainError):
    """An error only the HTTP layer knows (a body too large, a method not allowed): it names its status."""

    status = 400
    code = "BAD_REQUEST"
    title = "Bad request"

    def __init__(
        self,
        detail: str = "",
        *,
        status: int | None = None,
        headers: dict[str, str] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(detail, **kwargs)
        if status is not None:
            self.status = status
        self.headers = headers or {}


def status_of(error: DomainError) -> int:
    if isinstance(error, Problem):
        return error.status
    return next((STATUS_BY_KIND[k] for k in type(error).__mro__ if k in STATUS_BY_KIND), 400)


def problem_body(error: DomainError) -> dict[str, Any]:
    return {
        "type": f"/problems/{error.code.lower().replace('_', '-')}",
        "title": error.title,
        "status": status_of(error),
        "code": error.code,
        "detail": error.detail,
        **error.extra,
    }


def problem_headers(error: DomainError) -> dict[str, str]:
    headers = dict(error.headers) if isinstance(error, Problem) else {}
    if error.retry_after is not None:
        headers["Retry-After"] = str(error.retry_after)
    return headers


_DRF_CODES: dict[type[Exception], tuple[str, str]] = {
    drf_exceptions.ParseError: ("MALFORMED_JSON", "The body is not valid JSON"),
    drf_exceptions.UnsupportedMediaType: ("UNSUPPORTED_MEDIA_TYPE", "Content-Type must be application/json"),
    drf_exceptions.NotAuthenticated: ("UNAUTHENTICATED", "A bearer token is required"),
    drf_exceptions.AuthenticationFailed: ("UNAUTHENTICATED", "The bearer token is not valid"),
    drf_exceptions.PermissionDenied: ("FORBIDDEN", "Not allowed"),
    drf_exceptions.NotFound: ("NOT_FOUND", "Not found"),
    drf_exceptions.MethodNotAllowed: ("METHOD_NOT_ALLOWED", "Method not allowed"),
    drf_exceptions.NotAcceptable: ("NOT_ACCEPTABLE", "Not acceptable"),
    drf_exceptions.Throttled: ("THROTTLED", "Too many requests"),
    drf_exceptions.ValidationError: ("INVALID_INPUT", "The request body is not valid"),
}


def problem_response(error: DomainError) -> Response:
    response = Response(problem_body(error), status=status_of(error), content_type=PROBLEM_CONTENT_TYPE)
    for name, value in problem_headers(error).items():
        response[name] = value
    return response


class ServiceUnavailable(Unavailable):
    code = "SERVICE_UNAVAILABLE"
    title = "A dependency of the platform is unavailable"
    retry_after = 2


# A database or Redis that cannot be reached (or dropped the connection mid-request). Django marks a broken
# connection unusable and opens a new one on the next request, so the platform serves again on its own.
DEPENDENCY_ERRORS: tuple[type[Exception], ...] = (
    db.OperationalError,
    db.InterfaceError,
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
)


def unavailable(exc: Exception) -> ServiceUnavailable:
    logger.warning("dependency unavailable: %s: %s", type(exc).__name__, exc)
    return ServiceUnavailable("the database or Redis cannot be reached; try again shortly")


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """DRF exception handler: domain problems, DRF errors and unreachable dependencies become problem+json;
    anything else propagates (``ApiProblemMiddleware`` answers it as a 500 problem)."""
    if isinstance(exc, DEPENDENCY_ERRORS):
        return problem_response(unavailable(exc))
    if isinstance(exc, DomainError):
        return problem_response(exc)
    if isinstance(exc, Http404):
        return problem_response(NotFound(str(exc) or "Not found"))
    if isinstance(exc, drf_exceptions.APIException):
        code, title = next(
            ((c, t) for cls, (c, t) in _DRF_CODES.items() if isinstance(exc, cls)), ("ERROR", "Error")
        )
        detail = exc.detail if isinstance(exc.detail, str) else exc.get_full_details()
        problem = Problem(
            str(detail) if isinstance(detail, str) else title, status=exc.status_code, code=code
        )
        problem.title = title
        if not isinstance(detail, str):
            problem.extra["errors"] = detail
        headers = {}
        if getattr(exc, "auth_header", None):
            headers["WWW-Authenticate"] = str(exc.auth_header)  # type: ignore[attr-defined]
        problem.headers = headers
        return problem_response(problem)
    return None
