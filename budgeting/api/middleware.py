"""Everything under ``/api/`` answers problem+json, whatever fails: unknown paths (404), methods a view does
not take (405), a dependency that is down (503 with ``Retry-After``), bugs (500); never HTML pages."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Callable

from django.conf import settings
from django.core.handlers.wsgi import LimitedStream
from django.http import HttpRequest, HttpResponse, JsonResponse

from budgeting.api.problems import (
    DEPENDENCY_ERRORS,
    PROBLEM_CONTENT_TYPE,
    Problem,
    problem_body,
    problem_headers,
    status_of,
    unavailable,
)
from budgeting.catalog.errors import DomainError

logger = logging.getLogger(__name__)

API_PREFIX = "/api/"

_CODES = {
    400: ("BAD_REQUEST", "Bad request", "the request could not be read"),
    403: ("FORBIDDEN", "Forbidden", "the request is not allowed"),
    404: ("NOT_FOUND", "Not found", "no such endpoint; the API's index is /api/v1/"),
    405: ("METHOD_NOT_ALLOWED", "Method not allowed", "this endpoint does not take that method"),
    406: ("NOT_ACCEPTABLE", "Not acceptable", "the answer is JSON: accept application/json"),
    411: ("LENGTH_REQUIRED", "Length required", "send the body with a Content-Length"),
}


def _problem_response(error: DomainError) -> JsonResponse:
    response = JsonResponse(problem_body(error), status=status_of(error), content_type=PROBLEM_CONTENT_TYPE)
    for name, value in problem_headers(error).items():
        response[name] = value
    return response


class ApiProblemMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if request.path.startswith(API_PREFIX) and _chunked(request):
            refused = _read_chunked_body(request)
            if refused is not None:
                return refused
        response = self.get_response(request)
        if not request.path.startswith(API_PREFIX) or response.status_code < 400:
            return response
        if response.get("Content-Type", "").startswith(PROBLEM_CONTENT_TYPE) and _is_json(response):
            return response
        code, title, detail = _CODES.get(
            response.status_code, ("ERROR", "Error", "the request could not be served")
        )
        problem = Problem(detail, status=response.status_code, code=code)
        problem.title = title
        answer = _problem_response(problem)
        if "Allow" in response:
            answer["Allow"] = response["Allow"]
        return answer

    def process_exception(self, request: HttpRequest, exc: Exception) -> HttpResponse | None:
        return exception_answer(request, exc)


def exception_answer(request: HttpRequest, exc: Exception) -> HttpResponse | None:
    """The answer to an exception a view (or the hot path) raised: 503 for a dependency that is down, a 500
    problem (logged with its traceback) under ``/api/``; None elsewhere (Django's own 500 page)."""
    if isinstance(exc, DEPENDENCY_ERRORS):
        error: DomainError = unavailable(exc)
        if not request.path.startswith(API_PREFIX):
            response = HttpResponse(error.detail, status=503, content_type="text/plain; charset=utf-8")
            response["Retry-After"] = str(error.retry_after)
            return response
        return _problem_response(error)
    if not request.path.startswith(API_PREFIX):
        return None
    logger.exception("unhandled error on %s %s", request.method, request.path)
    return _problem_response(Problem("an unexpected error occurred", status=500, code="INTERNAL_ERROR"))


def _chunked(request: HttpRequest) -> bool:
    return "chunked" in request.META.get("HTTP_TRANSFER_ENCODING", "").lower() and not request.META.get(
        "CONTENT_LENGTH"
    )


def _read_chunked_body(request: HttpRequest) -> HttpResponse | None:
    """A body sent with ``Transfer-Encoding: chunked`` has no Content-Length, so Django would read it as
    empty. The server (gunicorn) decodes the chunks: read them here, bounded, and set the request's length."""
    limit = settings.MAX_REQUEST_BYTES
    stream = request.META.get("wsgi.input")
    if stream is None:
        return _problem_response(_length_required())
    body = stream.read(limit + 1)
    if len(body) > limit:
        return _problem_response(Problem(f"body exceeds {limit} bytes", status=413, code="BODY_TOO_LARGE"))
    request.META["CONTENT_LENGTH"] = str(len(body))
    request._stream = LimitedStream(io.BytesIO(body), len(body))  # type: ignore[assignment]
    return None


def _length_required() -> Problem:
    code, title, detail = _CODES[411]
    problem = Problem(detail, status=411, code=code)
    problem.title = title
    return problem


def _is_json(response: HttpResponse) -> bool:
    if getattr(response, "streaming", False):
        return True
    try:
        json.loads(response.content)
    except ValueError:
        return False
    return True
