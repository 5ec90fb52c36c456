"""The admission asked for as a request reaches the proxy's routes, while LiteLLM authenticates it.

LiteLLM calls its first hook (``async_pre_call_hook``) only once it has authenticated the key and prepared
the request: about 6 ms of its own work a call on a 2-core machine, most of its overhead. Our admission
takes as long again, and until now it started only then. ``AdmitOnArrival`` sits between LiteLLM's
middleware and its routes (``install``: after its body limits, decompression, admission control and error
handling, before the route's authentication) and, for a request to the chat completions route that looks
exactly like one LiteLLM accepted in the last ``ttl_s`` (``KnownCallers``: a digest of the client's
host, the query string and every header but the few that change from call to call, remembered with the
caller LiteLLM found by the pre-call hook), reads its body, maps it as that caller's and puts its admission
on the wire; then the request goes on to LiteLLM unchanged, its body replayed.

Nothing rests on this guess. The pre-call hook maps the request again, as LiteLLM hands it over after its
own checks, with the caller LiteLLM authenticated, and adopts the early admission only if it is the same
admission (same group, body and trace; its ``requestId`` is one of its own, ``litellm-<uuid>``, as LiteLLM's
call id is not known yet); otherwise the early one is released and the call admitted as before. So:

- a request unlike any LiteLLM accepted within ``ttl_s`` never causes a call to us before LiteLLM accepts
  it, and credentials are taken to be in what the digest covers (headers, query string, client host);
- a request LiteLLM refuses (a key revoked since, a limit of its own) has its early admission released
  once the proxy has answered (``Arrival.take`` when the application returns), and its digest forgotten:
  the next request like it waits for LiteLLM to accept it again;
- an early admission the pre-call hook does not adopt (the call changed on the way, or the hook let it
  through unadmitted) is released, and its group not admitted early for ``ttl_s``;
- a call under the caller's own ``requestId`` is admitted from the pre-call hook (were the call to change
  on the way, a second admission under the caller's key would be a conflict);
- a body not sent as plain JSON with a ``Content-Length`` of at most ``max_body`` bytes is left to the
  pre-call hook.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, MutableMapping
from contextvars import ContextVar
from typing import Any, Final, Generic, TypeVar

from tokenbudget_litellm.mapping import Caller

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

T = TypeVar("T")

_CHAT_ROUTES: Final = {("http", "POST", path) for path in ("/chat/completions", "/v1/chat/completions")}
# Headers that differ from one call of the same caller to the next and carry no credentials: left out of
# the digest, so a caller's calls look alike.
_VOLATILE: Final = frozenset(
    {
        b"content-length", b"content-type", b"content-encoding", b"transfer-encoding", b"expect",
        b"accept", b"accept-encoding", b"connection", b"keep-alive", b"traceparent", b"tracestate",
        b"baggage", b"x-request-id", b"x-litellm-call-id", b"x-stainless-retry-count",
        b"x-stainless-read-timeout", b"x-stainless-timeout",
    }
)  # fmt: skip
_PROXY_MODULE: Final = "litellm.proxy.proxy_server"
_INSTALLED: Final = "_tokenbudget_admit_on_arrival"
_NOT_FOUND: Final = "admitOnArrival: the proxy's routes not found behind its middleware; admitted by hooks"


class Arrival(Generic[T]):
    """One request to the chat route as it arrived: its digest, its early admission and the admissions the
    hooks left in flight for it (their keys, for the hook to release what no later hook took)."""

    def __init__(self, credentials: str) -> None:
        self.credentials = credentials
        self.in_flight: list[str] = []
        self._early: T | None = None

    def begin(self, early: T) -> None:
        self._early = early

    def take(self) -> T | None:
        """The early admission, if any, now the taker's (only one ever gets it)."""
        early, self._early = self._early, None
        return early


ARRIVAL: ContextVar[Arrival[Any] | None] = ContextVar("tokenbudget_arrival", default=None)
"""The request being served, for the hooks LiteLLM calls within it."""


class KnownCallers:
    """The caller LiteLLM authenticated for each request digest it accepted within ``ttl_s`` (at most
    ``size``, the least recently seen forgotten first)."""

    def __init__(
        self, ttl_s: float, size: int = 10_000, monotonic: Callable[[], float] = time.monotonic
    ) -> None:
        self.ttl_s = ttl_s
        self._size = size
        self._monotonic = monotonic
        self._seen: OrderedDict[str, tuple[Caller, float]] = OrderedDict()

    def remember(self, credentials: str, caller: Caller) -> None:
        self._seen[credentials] = (caller, self._monotonic())
        self._seen.move_to_end(credentials)
        while len(self._seen) > self._size:
            self._seen.popitem(last=False)

    def forget(self, credentials: str) -> None:
        self._seen.pop(credentials, None)

    def get(self, credentials: str) -> Caller | None:
        seen = self._seen.get(credentials)
        if seen is None:
            return None
        if self._monotonic() - seen[1] > self.ttl_s:
            del self._seen[credentials]
            return None
        return seen[0]


class AdmitOnArrival(Generic[T]):
    """ASGI middleware; see the module docstring. ``begin(data, caller)`` maps the parsed body (the
    ``traceparent`` header where LiteLLM puts it) and starts its admission, returning once the admission is
    on the wire (LiteLLM's work on the request may not yield to the event loop until it calls the hooks),
    or returns ``None``; ``end(arrival)`` is called once the application has answered."""

    def __init__(
        self,
        app: App,
        *,
        callers: KnownCallers,
        begin: Callable[[dict[str, Any], Caller], Awaitable[T | None]],
        end: Callable[[Arrival[T]], None],
        max_body: int = 1 << 20,
    ) -> None:
        self.app = app
        self.callers = callers
        self._begin = begin
        self._end = end
        self._max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope.get("type"), scope.get("method"), scope.get("path")) not in _CHAT_ROUTES:
            await self.app(scope, receive, send)
            return
        arrival: Arrival[T] = Arrival(request_digest(scope))
        token = ARRIVAL.set(arrival)
        try:
            caller = self.callers.get(arrival.credentials)
            if caller is not None:
                receive = await self._early(arrival, caller, scope, receive)
            await self.app(scope, receive, send)
        finally:
            ARRIVAL.reset(token)
            self._end(arrival)

    async def _early(self, arrival: Arrival[T], caller: Caller, scope: Scope, receive: Receive) -> Receive:
        """Read the body and start its admission; what the application is to receive."""
        headers: dict[bytes, bytes] = {}
        for name, value in scope.get("headers") or ():
            # The first of a repeated header, as LiteLLM reads them.
            headers.setdefault(name.lower(), value)
        length = headers.get(b"content-length", b"")
        if (
            not length.isdigit()
            or int(length) > self._max_body
            or headers.get(b"content-encoding", b"identity") != b"identity"
        ):
            return receive
        received: list[Message] = []
        chunks: list[bytes] = []
        while True:
            message = await receive()
            received.append(message)
            if message.get("type") != "http.request":
                break
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break

        async def replay() -> Message:
            return received.pop(0) if received else await receive()

        try:
            data = json.loads(b"".join(chunks))
        except Exception:  # not JSON, or nested too deep to parse: LiteLLM answers it
            return replay
        if not isinstance(data, dict):
            return replay
        traceparent = headers.get(b"traceparent")
        if traceparent is not None:
            data["proxy_server_request"] = {"headers": {"traceparent": traceparent.decode("latin-1")}}
        try:
            early = await self._begin(data, caller)
        except Exception:
            # An early start is only ever a head start: the pre-call hook admits the call as before.
            logger.exception("the admission could not be started on arrival")
            return replay
        if early is not None:
            arrival.begin(early)
        return replay


def request_digest(scope: Scope) -> str:
    """A digest of what may identify a request's caller: the client's host, the query string and every
    header but the volatile ones (names and values)."""
    digest = hashlib.blake2b(digest_size=16)
    client = scope.get("client")
    digest.update(str(client[0] if client else None).encode() + b"\0")
    digest.update(scope.get("query_string", b"") + b"\0")
    for name, value in sorted((name.lower(), value) for name, value in scope.get("headers") or ()):
        if name not in _VOLATILE:
            digest.update(name + b"\0" + value + b"\0")
    return digest.hexdigest()


def install(middleware: Callable[[App], App]) -> bool:
    """Put ``middleware`` in front of the LiteLLM proxy's routes in this process, once (behind its
    middleware); ``False`` if this is not a proxy's process (the hook loaded by other code) or its
    application is not built as this expects."""
    proxy = sys.modules.get(_PROXY_MODULE)
    app = getattr(proxy, "app", None)
    router = getattr(app, "router", None)
    if app is None or router is None:
        return False
    if getattr(app, _INSTALLED, False):
        return True
    if app.middleware_stack is None:
        # Not built yet: in front of the routes once Starlette builds it (when the application first runs).
        build = app.build_middleware_stack

        def built() -> App:
            stack: App = build()
            if not _before(stack, router, middleware):
                logger.warning(_NOT_FOUND)
            return stack

        app.build_middleware_stack = built
    elif not _before(app.middleware_stack, router, middleware):
        logger.warning(_NOT_FOUND)
        return False
    setattr(app, _INSTALLED, True)
    return True


def _before(stack: Any, router: Any, middleware: Callable[[App], App]) -> bool:
    """Wrap ``router`` where the middleware chain ``stack`` (each layer's ``app`` the next) calls it."""
    layer = stack
    for _ in range(100):
        inner = getattr(layer, "app", None)
        if inner is None:
            return False
        if inner is router:
            layer.app = middleware(router)
            return True
        layer = inner
    return False
