"""Domain errors and their single translation to ``application/problem+json``.

Every error a client can cause has a stable machine-readable ``code``. Views raise ``Problem`` subclasses (or
DRF's own exceptions); ``exception_handler`` is the one place that turns them into responses.
"""

from __future__ import annotations

from typing import Any

from django.http import Http404
from rest_framework import exceptions as drf_exceptions
from rest_framework.response import Response

PROBLEM_CONTENT_TYPE = "application/problem+json"


class Problem(Exception):
    """A client-visible error: HTTP status, stable code, human title and detail, extra members."""

    status = 400
    code = "BAD_REQUEST"
    title = "Bad request"

    def __init__(
        self,
        detail: str = "",
        *,
        status: int | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(detail or self.title)
        self.detail = detail or self.title
        if status is not None:
            self.status = status
        if code is not None:
            self.code = code
        self.headers = headers or {}
        self.extra = extra

    def body(self) -> dict[str, Any]:
        return {
            "type": f"https://errors.token-budget.invalid/{self.code.lower().replace('_', '-')}",
            "title": self.title,
            "status": self.status,
            "code": self.code,
            "detail": self.detail,
            **self.extra,
        }


class InvalidInput(Problem):
    status = 400
    code = "INVALID_INPUT"
    title = "The request body is not valid"


class NotFound(Problem):
    status = 404
    code = "NOT_FOUND"
    title = "Not found"


class Conflict(Problem):
    status = 409
    code = "CONFLICT"
    title = "Conflict with the current state"


class Unavailable(Problem):
    status = 503
    code = "UNAVAILABLE"
    title = "Temporarily unavailable"


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


def problem_response(problem: Problem) -> Response:
    response = Response(problem.body(), status=problem.status, content_type=PROBLEM_CONTENT_TYPE)
    for name, value in problem.headers.items():
        response[name] = value
    return response


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """DRF exception handler: domain problems and DRF errors become problem+json; others propagate."""
    if isinstance(exc, Problem):
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
