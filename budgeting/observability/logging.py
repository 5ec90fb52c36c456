"""Structured logs (structlog): one JSON object a line in production, readable ``key=value`` lines in a
terminal, and one line per HTTP request carrying its request id — for API calls also the client, tenant,
answer code and reservation id.

Everything goes through the standard library's logging (Django, Celery and our modules alike), rendered by
structlog's formatter. Two filters keep the lines people read useful: expected client errors (4xx) are not
repeated as Django warnings (the request line carries their code), and the beat's every-2-seconds queue poll
is logged at debug level only.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import Callable
from typing import Any

import structlog
from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.utils.functional import SimpleLazyObject

# Beat tasks that run every few seconds: their "sent", "received" and "succeeded" lines are debug noise.
POLL_TASKS = ("reconciliation.admit_queued",)
_CELERY_LOGGERS = ("celery.app.trace", "celery.worker.strategy", "celery.beat")
# Requests logged at debug level: the Prometheus scrape comes every few seconds.
QUIET_PATHS = ("/metrics",)
# Where a body parsed before the view (by budgeting.api.hotpath) is kept on Django's request: the view's
# parser answers it instead of parsing the body again, and the request log reads it.
PARSED_BODY = "api_body"
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_MAX_PARSED_BYTES = 64 * 1024

logger = structlog.get_logger("budgeting.requests")


def settings_logging(*, json_lines: bool, level: str) -> dict[str, Any]:
    """Configure structlog and return the ``LOGGING`` setting that renders every record through it."""
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if json_lines
        else structlog.dev.ConsoleRenderer(colors=False, exception_formatter=structlog.dev.plain_traceback)
    )
    tail = [structlog.processors.format_exc_info] if json_lines else []
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "structured": {
                "()": structlog.stdlib.ProcessorFormatter,
                "foreign_pre_chain": shared,
                "processors": [
                    structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    *tail,
                    renderer,
                ],
            }
        },
        "filters": {
            "quiet_polls": {"()": QuietPolls},
            "expected_client_errors": {"()": ExpectedClientErrors},
        },
        "handlers": {
            "console": {
                "class": "logging.StreamHandler",
                "formatter": "structured",
                "filters": ["quiet_polls"],
            }
        },
        "loggers": {"django.request": {"filters": ["expected_client_errors"]}},
        "root": {"handlers": ["console"], "level": level},
    }


class QuietPolls(logging.Filter):
    """Lowers Celery's lines about the poll tasks to DEBUG (kept only when debug logging is on)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name not in _CELERY_LOGGERS or record.levelno > logging.INFO:
            return True
        message = record.getMessage()
        if not any(task in message for task in POLL_TASKS):
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger().isEnabledFor(logging.DEBUG)


class ExpectedClientErrors(logging.Filter):
    """Drops Django's "Not Found: /api/..." style warnings for 4xx answers: they are expected (a quota, a
    bad request), and the request's own line already says which."""

    def filter(self, record: logging.LogRecord) -> bool:
        status = getattr(record, "status_code", None)
        return not (isinstance(status, int) and 400 <= status < 500)


class RequestLogMiddleware:
    """One line per request: method, path, status, duration and request id (``X-Request-ID`` when the
    client sent a usable one, else a new one; echoed in the response). Everything logged while the request
    runs carries the same request id."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if request.path.startswith(settings.STATIC_URL):
            return self.get_response(request)
        offered = request.headers.get("X-Request-ID", "")
        request_id = offered if _REQUEST_ID.fullmatch(offered) else uuid.uuid4().hex
        structlog.contextvars.clear_contextvars()
        structlog.contextvars.bind_contextvars(request_id=request_id)
        started = time.perf_counter()
        try:
            response = self.get_response(request)
            response["X-Request-ID"] = request_id
            fields = api_fields(request, response) if request.path.startswith("/api/") else {}
            level = logging.ERROR if response.status_code >= 500 else logging.INFO
            if request.path in QUIET_PATHS and level == logging.INFO:
                level = logging.DEBUG
            logger.log(
                level,
                "api call" if fields else "request",
                method=request.method,
                path=request.path,
                status=response.status_code,
                duration_ms=round((time.perf_counter() - started) * 1000, 1),
                **fields,
            )
            return response
        finally:
            structlog.contextvars.clear_contextvars()


def api_fields(request: HttpRequest, response: HttpResponse) -> dict[str, Any]:
    """The client, tenant, answer code and reservation id of an API call, from what the request and the
    response already hold (no query): the authenticated client, the parsed request body and the answer."""
    body = _answer(response)
    sent = _parsed_request(request, response)
    kwargs = request.resolver_match.kwargs if request.resolver_match else {}
    fields = {
        "client": _client(request),
        "tenant": body.get("tenantId") or sent.get("tenantId"),
        "answer": body.get("code") or body.get("decision") or body.get("state"),
        "reservation_id": body.get("reservationId") or kwargs.get("reservation_id"),
        "client_request_id": body.get("requestId") or sent.get("requestId"),
    }
    return {key: value for key, value in fields.items() if value is not None}


def _client(request: HttpRequest) -> str | None:
    # DRF puts the authenticated service client on the request; the session's lazy user is never evaluated
    # here (it could mean a query).
    user = request.__dict__.get("user")
    if user is None or isinstance(user, SimpleLazyObject):
        return None
    name = getattr(user, "name", None)
    return name if isinstance(name, str) else None


def _answer(response: HttpResponse) -> dict[str, Any]:
    data = getattr(response, "data", None)
    if isinstance(data, dict):
        return data
    if getattr(response, "streaming", False) or "json" not in response.get("Content-Type", ""):
        return {}
    if len(response.content) > _MAX_PARSED_BYTES:
        return {}
    try:
        parsed = json.loads(response.content)
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _parsed_request(request: HttpRequest, response: HttpResponse) -> dict[str, Any]:
    """The request body already parsed, by the hot path (``budgeting.api.hotpath``) or by DRF for the view
    (never parsed here: that could fail or be slow)."""
    data = request.__dict__.get(PARSED_BODY)
    if data is None:
        context = getattr(response, "renderer_context", None) or {}
        data = getattr(context.get("request"), "_full_data", None)
    return data if isinstance(data, dict) else {}
