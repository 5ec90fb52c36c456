"""The admission asked for as a request arrives at the proxy, while LiteLLM authenticates and prepares it.

LiteLLM calls its first hook (``async_pre_call_hook``) only once it has authenticated the key and prepared
the request: about 6 ms of its own work a call on a 2-core machine, most of its overhead. Our admission
takes as long again, and until now it started only then. ``AdmitOnArrival`` sits in front of the proxy's
application (``install``) and, for a request to the chat completions route whose credentials LiteLLM
authenticated recently (``KnownCallers``: the credential headers' digest and the caller LiteLLM found,
remembered by the pre-call hook for ``ttl_s``), reads its body, maps it as that caller's and puts its
admission on the wire before LiteLLM starts; the request then goes on to LiteLLM unchanged, its body
replayed.

Nothing rests on this guess. The pre-call hook maps the request again, as LiteLLM hands it over after its
own checks, with the caller LiteLLM authenticated, and adopts the early admission only if it is the very
same admission request (same group, body, key and trace); otherwise the early one is released in full and
the call is admitted as before. So:

- credentials LiteLLM has not accepted within ``ttl_s`` never cause a call to us before it accepts them;
- a request LiteLLM refuses (its key revoked since, a limit of its own) or that never reaches the hooks
  has its early admission released when the proxy has answered (``Arrival.take`` in the ``finally``);
- a request the pre-call hook would map differently (a team's settings, a model alias LiteLLM applies) is
  admitted as it reaches the hook: its early admission is released, and the group is not admitted early
  again for ``ttl_s``.

The request's call id is the caller's ``x-litellm-call-id`` or, if it sent none, one made here and added
to the request's headers, so LiteLLM's call id, and so the admission's default ``requestId``, is the same
in both mappings. A body not sent as plain JSON with a ``Content-Length`` of at most ``max_body`` bytes is
left to the pre-call hook. The call is not otherwise changed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import time
import uuid
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

_CALL_ID_HEADER: Final = b"x-litellm-call-id"
_CHAT_ROUTES: Final = {("http", "POST", path) for path in ("/chat/completions", "/v1/chat/completions")}
# Where a key may travel (Bearer, Azure's api-key, Anthropic's x-api-key, LiteLLM's own and custom ones).
_CREDENTIAL_WORDS: Final = (b"auth", b"key", b"token")
_PROXY_MODULE: Final = "litellm.proxy.proxy_server"


class Arrival(Generic[T]):
    """One request to the chat route as it arrived: its credentials' digest and its early admission."""

    def __init__(self, credentials: str) -> None:
        self.credentials = credentials
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
    """The caller LiteLLM authenticated for each credential digest it accepted within ``ttl_s`` (at most
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

    def get(self, credentials: str) -> Caller | None:
        seen = self._seen.get(credentials)
        if seen is None:
            return None
        if self._monotonic() - seen[1] > self.ttl_s:
            del self._seen[credentials]
            return None
        return seen[0]


class AdmitOnArrival(Generic[T]):
    """ASGI middleware; see the module docstring. ``begin(data, caller)`` maps the parsed body (its
    ``litellm_call_id`` and traceparent set as LiteLLM will) and starts its admission, returning once the
    admission is on the wire (LiteLLM's work on the request may not yield to the event loop until it calls
    the hooks), or returns ``None``; ``drop(early)`` releases an early admission nobody took."""

    def __init__(
        self,
        app: App,
        *,
        callers: KnownCallers,
        begin: Callable[[dict[str, Any], Caller], Awaitable[T | None]],
        drop: Callable[[T], None],
        max_body: int = 1 << 20,
    ) -> None:
        self.app = app
        self.callers = callers
        self._begin = begin
        self._drop = drop
        self._max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope.get("type"), scope.get("method"), scope.get("path")) not in _CHAT_ROUTES:
            await self.app(scope, receive, send)
            return
        arrival: Arrival[T] = Arrival(credentials_digest(scope.get("headers") or ()))
        token = ARRIVAL.set(arrival)
        try:
            caller = self.callers.get(arrival.credentials)
            if caller is not None:
                scope, receive = await self._early(arrival, caller, scope, receive)
            await self.app(scope, receive, send)
        finally:
            ARRIVAL.reset(token)
            early = arrival.take()
            if early is not None:
                self._drop(early)

    async def _early(
        self, arrival: Arrival[T], caller: Caller, scope: Scope, receive: Receive
    ) -> tuple[Scope, Receive]:
        """Read the body (replayed to the application), start its admission; the scope with the call id."""
        headers = {name.lower(): value for name, value in scope.get("headers") or ()}
        length = headers.get(b"content-length", b"")
        if (
            not length.isdigit()
            or int(length) > self._max_body
            or headers.get(b"content-encoding", b"identity") != b"identity"
        ):
            return scope, receive
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
        except ValueError:
            return scope, replay
        if not isinstance(data, dict):
            return scope, replay
        call_id = headers.get(_CALL_ID_HEADER, b"").decode("latin-1")
        if not call_id:
            call_id = str(uuid.uuid4())
            scope = {**scope, "headers": [*(scope.get("headers") or ()), (_CALL_ID_HEADER, call_id.encode())]}
        data["litellm_call_id"] = call_id
        traceparent = headers.get(b"traceparent")
        if traceparent is not None:
            data["proxy_server_request"] = {"headers": {"traceparent": traceparent.decode("latin-1")}}
        try:
            early = await self._begin(data, caller)
        except Exception:
            # An early start is only ever a head start: the pre-call hook admits the call as before.
            logger.exception("the admission could not be started on arrival")
            return scope, replay
        if early is not None:
            arrival.begin(early)
        return scope, replay


def credentials_digest(headers: Any) -> str:
    """A digest of the headers that may carry a key (their names and values), which LiteLLM
    authenticates."""
    digest = hashlib.blake2b(digest_size=16)
    for name, value in sorted((name.lower(), value) for name, value in headers):
        if any(word in name for word in _CREDENTIAL_WORDS):
            digest.update(name + b"\0" + value + b"\0")
    return digest.hexdigest()


def install(middleware: Callable[[App], App]) -> bool:
    """Put ``middleware`` in front of the LiteLLM proxy's application in this process; ``False`` if this is
    not a proxy's process (the hook loaded by other code)."""
    proxy = sys.modules.get(_PROXY_MODULE)
    app = getattr(proxy, "app", None)
    if app is None:
        return False
    # Starlette builds the stack when the application first runs (the proxy's start-up, which loads the
    # hook): in front of it is in front of all of LiteLLM's middleware.
    if app.middleware_stack is not None:
        app.middleware_stack = middleware(app.middleware_stack)
        return True
    build = app.build_middleware_stack
    app.build_middleware_stack = lambda: middleware(build())
    return True
