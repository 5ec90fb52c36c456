"""The gateway's per-call requests — the admission, the lifecycle calls and the usage reports — served without
the middleware and the framework layers that do nothing for them.

A gateway makes two of these calls for every model call (the admission, then the final usage). Through
Django's whole middleware stack and DRF's view machinery each spends CPU in layers that do nothing for a
bearer-token JSON call: static files, sessions, CSRF (exempt), the session user, messages, sign-in lockouts,
URL dispatch to DRF, its authentication, negotiation, parsing and rendering classes. Without them the API
serves 7–8 % more admit + release pairs a second, and an admission made alone takes 3–5 % less time
(bench/hotpath_bench.py); through the LiteLLM proxy a call's latency moved by nothing measurable
(bench/gateway_bench.py's ``views`` arm; the figures are in the README).

``HotPathMiddleware`` sits after the middleware that does matter for the API (security headers and the
HTTPS redirect, the request log and its ``X-Request-ID``, problem+json, ``X-Frame-Options``) and before the
rest. It answers a request itself only when it is plainly well-formed: a POST to one of these calls, a JSON
body of a declared length within ``MAX_REQUEST_BYTES`` that parses strictly and that the compiled
validator of the call's serializer accepts (``fastpath``), JSON accepted in return, and a known bearer
token. It then runs the same operation the DRF view runs (``operations``) and answers as the view would:
the same body, status, headers (``Allow`` included), the same problem+json for an error (DRF's exception
handler's). Anything else — a missing or malformed header, an unknown token, a body the serializer must
judge, another content type — goes on to Django and DRF unchanged, and is answered as before, nothing having
been written (``tests/api/test_hotpath.py`` checks both ways answer alike).

One statement fewer than the view: an admission, the usage reports and a lifecycle call whose first
statement is the reservation's read (``LifecycleCall.checks_catalog``), are authenticated without the catalog
version read (``caller_for_token(checked=False)``), since their statement compares the version itself (the
admission's reserving statement requires it; before any other answer the admission reads the version first:
``orchestrator.admit``; the usage reports' read of their reservations: ``lifecycle.read_together``); when it
cannot (``CatalogUnchecked``: the catalog moved, nothing was found, the statement failed), nothing has been
written and the call is made again after the catalog read.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any, Final

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.urls import Resolver404, resolve
from rest_framework.response import Response

from budgeting.api import operations, views
from budgeting.api.auth import caller_for_token
from budgeting.api.fastpath import fast_validator
from budgeting.api.middleware import exception_answer
from budgeting.api.parsers import BadJSON, loads_strict, media_charset
from budgeting.api.problems import exception_handler
from budgeting.api.renderers import FastJSONRenderer
from budgeting.api.serializers import AdmissionIn, UsageReportsIn
from budgeting.catalog.errors import CatalogUnchecked
from budgeting.catalog.snapshot import Caller
from budgeting.observability.logging import PARSED_BODY

_PREFIX: Final = "/api/v1/"
# What an Accept header may say for the hot path to answer (any other goes to DRF's negotiation).
_PLAIN_ACCEPT: Final = frozenset({"", "*/*", "application/json"})
_RENDERER: Final = FastJSONRenderer()

Call = Callable[[Caller], operations.Answer]


class HotPathMiddleware:
    """See the module docstring."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        found = _plain_call(request)
        if found is None:
            return self.get_response(request)
        view, token, call, checks_catalog = found
        try:
            caller = caller_for_token(token, checked=not checks_catalog)
            if caller is None:
                return self.get_response(request)
            try:
                answer = _called(request, call, caller)
            except CatalogUnchecked:
                # The catalog moved since this process last read it (or the call found nothing to compare
                # with): again, after the catalog read. Nothing was written.
                caller = caller_for_token(token)
                if caller is None:
                    return self.get_response(request)
                answer = _called(request, call, caller)
        except Exception as exc:
            # As the view's: DRF's exception handler (a domain problem, a dependency down), else a 500.
            problem = exception_handler(exc, {})
            if problem is None:
                unhandled = exception_answer(request, exc)
                if unhandled is None:
                    raise
                return unhandled
            return _rendered(problem, view)
        response = Response(answer.body, status=answer.status)
        for name, value in answer.headers.items():
            response[name] = value
        return _rendered(response, view)


def _called(request: HttpRequest, call: Call, caller: Caller) -> operations.Answer:
    # As DRF's authentication leaves them: the request log names the client from here.
    request.user = caller.client  # type: ignore[assignment]
    request.auth = caller  # type: ignore[attr-defined]
    return call(caller)


def _plain_call(request: HttpRequest) -> tuple[type[views.TenantScopedView], str, Call, bool] | None:
    """The view a plainly well-formed hot request is for, its bearer token, the call to run given the caller
    and whether that call checks an unchecked caller's catalog version itself (the admission,
    ``LifecycleCall``); None for any other request."""
    if request.method != "POST" or not request.path_info.startswith(_PREFIX):
        return None
    meta = request.META
    length = meta.get("CONTENT_LENGTH", "")
    token = _bearer_token(request)
    if (
        token is None
        or not length.isdigit()
        or int(length) > settings.MAX_REQUEST_BYTES
        or meta.get("HTTP_ACCEPT", "") not in _PLAIN_ACCEPT
        or meta.get("CONTENT_TYPE", "").split(";")[0].strip().lower() != "application/json"
        or media_charset(meta.get("CONTENT_TYPE", "")) not in (None, "utf-8", "utf8")
    ):
        return None
    try:
        match = resolve(request.path_info)
    except Resolver404:
        return None
    view = getattr(match.func, "view_class", None)
    checks_catalog = False
    if view is views.AdmissionView:
        call = _admission(request)
        checks_catalog = True
    elif view is views.UsageReportsView:
        call = _usage_reports(request)
        checks_catalog = True
    elif isinstance(view, type) and issubclass(view, views.LifecycleView):
        call = _lifecycle(request, view.action, match.kwargs["reservation_id"])
        checks_catalog = operations.LIFECYCLE[view.action].checks_catalog
    else:
        return None
    if call is None:
        return None
    request.resolver_match = match
    return view, token, call, checks_catalog


def _body(request: HttpRequest) -> Any:
    """The body parsed strictly (None if it is not JSON), kept on the request: if the view takes the request
    after all, its parser answers it rather than parse the body again."""
    try:
        data = loads_strict(request.body)
    except BadJSON:
        return None
    setattr(request, PARSED_BODY, data)
    return data


def _admission(request: HttpRequest) -> Call | None:
    data = _body(request)
    validate = fast_validator(AdmissionIn)
    validated = None if validate is None else validate(data)
    if validated is None:
        return None
    key = request.headers.get("Idempotency-Key", "")
    return lambda caller: operations.admit(caller, validated, data, key)


def _usage_reports(request: HttpRequest) -> Call | None:
    validate = fast_validator(UsageReportsIn)
    validated = None if validate is None else validate(_body(request))
    if validated is None:
        return None
    return lambda caller: operations.usage_reports(caller, validated)


def _lifecycle(request: HttpRequest, action: str, reservation_id: str) -> Call | None:
    try:
        rid = uuid.UUID(reservation_id)
    except ValueError:
        return None
    call = operations.LIFECYCLE[action]
    data = _body(request)
    validate = fast_validator(call.serializer)
    validated = None if validate is None else validate(data)
    if validated is None:
        return None
    return lambda caller: call.run(caller, rid, validated)


def _bearer_token(request: HttpRequest) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header in ASCII, as DRF's authentication reads it."""
    header = request.META.get("HTTP_AUTHORIZATION", "")
    parts = header.split() if header.isascii() else []
    if len(parts) != 2 or parts[0].lower() != "bearer":
        return None
    return parts[1]


def _rendered(response: Response, view: type[views.TenantScopedView]) -> Response:
    """The answer rendered as the view's would be: the JSON renderer, DRF's ``Allow`` header and the
    ``Content-Length``."""
    response.accepted_renderer = _RENDERER
    response.accepted_media_type = _RENDERER.media_type
    response.renderer_context = {}  # type: ignore[attr-defined]  # DRF reads it; its stubs lack it
    response["Allow"] = ", ".join(view().allowed_methods)
    response.render()
    # As CommonMiddleware (which the hot path skips) sets it.
    response["Content-Length"] = str(len(response.content))
    return response
