"""The admission asked for as a request arrives at the proxy (``tokenbudget_litellm.arrival``): the middleware
against an application standing in for LiteLLM's on a real event loop (no LiteLLM, no database); through a
real LiteLLM proxy, in ``test_litellm_arrival_proxy``."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from tokenbudget_litellm import arrival
from tokenbudget_litellm.arrival import (
    ARRIVAL,
    AdmitOnArrival,
    Arrival,
    KnownCallers,
    Message,
    request_digest,
)
from tokenbudget_litellm.mapping import Caller

KEY = [(b"authorization", b"Bearer sk-known")]
CLIENT = ("10.0.0.7", 50123)
BODY = {"model": "support", "messages": [{"role": "user", "content": "Where is my order?"}]}
TEAM = Caller(team_id="team-7")


class Proxy:
    """What the middleware is given and does: the admissions it starts and drops, and what the application
    behind it (standing in for LiteLLM's) receives, in order."""

    def __init__(self, *, known: bool = True, take: bool = True, fail: BaseException | None = None) -> None:
        self.events: list[str] = []
        self.begun: list[tuple[dict[str, Any], Caller]] = []
        self.dropped: list[str] = []
        self.app_body = b""
        self.app_headers: dict[bytes, bytes] = {}
        self.taken: object = None
        self.callers = KnownCallers(ttl_s=60)
        if known:
            self.callers.remember(request_digest(scope_of(KEY)), TEAM)
        self._take = take
        self._fail = fail

    async def begin(self, data: dict[str, Any], caller: Caller) -> str:
        self.events.append("admission started")
        self.begun.append((data, caller))
        return f"early-{len(self.begun)}"

    def end(self, ended: Arrival[str]) -> None:
        self.events.append("answered")
        left = ended.take()
        if left is not None:
            self.dropped.append(left)

    async def app(self, scope: Any, receive: Any, send: Any) -> None:
        self.events.append("application started")
        self.app_headers = dict(scope["headers"])
        while True:
            message = await receive()
            self.app_body += message.get("body", b"")
            if not message.get("more_body"):
                break
        arrival = ARRIVAL.get()
        if self._take and arrival is not None:
            self.taken = arrival.take()
        if self._fail is not None:
            raise self._fail
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    def serve(
        self,
        body: bytes,
        *,
        headers: list[tuple[bytes, bytes]] | None = None,
        path: str = "/v1/chat/completions",
        chunk: int = 0,
        **middleware: Any,
    ) -> None:
        """One request through ``AdmitOnArrival`` in front of ``app``, its body sent in ``chunk``-byte
        messages (0: one)."""
        sent_headers = [*(KEY if headers is None else headers), (b"content-length", str(len(body)).encode())]
        size = chunk or max(len(body), 1)
        parts = [body[i : i + size] for i in range(0, len(body), size)] or [b""]
        messages = [
            {"type": "http.request", "body": part, "more_body": i < len(parts) - 1}
            for i, part in enumerate(parts)
        ]

        async def receive() -> Message:
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            return None

        scope = scope_of(sent_headers, path=path)
        stack = AdmitOnArrival(self.app, callers=self.callers, begin=self.begin, end=self.end, **middleware)
        asyncio.run(stack(scope, receive, send))


def scope_of(
    headers: list[tuple[bytes, bytes]], *, path: str = "/v1/chat/completions", **extra: Any
) -> dict[str, Any]:
    """An HTTP request's ASGI scope from ``CLIENT``; ``extra`` replaces its other fields."""
    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "headers": headers,
        "client": CLIENT,
        "query_string": b"",
    }
    return {**scope, **extra}


def test_a_known_callers_request_is_admitted_before_the_application_runs_and_reaches_it_unchanged() -> None:
    proxy = Proxy()
    body = json.dumps(BODY).encode()

    proxy.serve(body, chunk=7)

    assert proxy.events == ["admission started", "application started", "answered"]
    [(data, caller)] = proxy.begun
    assert (data, caller) == (BODY, TEAM)
    assert proxy.app_body == body
    assert proxy.app_headers == {**dict(KEY), b"content-length": str(len(body)).encode()}
    assert proxy.taken == "early-1" and proxy.dropped == []


def test_the_first_traceparent_is_the_admissions_as_it_is_litellms() -> None:
    proxy = Proxy()
    trace = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

    proxy.serve(json.dumps(BODY).encode(), headers=[*KEY, (b"traceparent", trace), (b"Traceparent", b"00-x")])

    [(data, _)] = proxy.begun
    assert data["proxy_server_request"] == {"headers": {"traceparent": trace.decode()}}


@pytest.mark.parametrize("fail", [None, RuntimeError("LiteLLM refused it")])
def test_an_early_admission_no_hook_took_is_dropped_once_the_proxy_has_answered(
    fail: BaseException | None,
) -> None:
    proxy = Proxy(take=False, fail=fail)

    if fail is None:
        proxy.serve(json.dumps(BODY).encode())
    else:
        with pytest.raises(RuntimeError):
            proxy.serve(json.dumps(BODY).encode())

    assert proxy.events == ["admission started", "application started", "answered"]
    assert proxy.dropped == ["early-1"]


@pytest.mark.parametrize(
    "headers",
    [
        [(b"authorization", b"Bearer sk-stranger")],
        [*KEY, (b"x-litellm-api-key", b"sk-other")],
        [],
    ],
    ids=["another key", "another key beside it", "no key"],
)
def test_credentials_litellm_has_not_accepted_ask_for_nothing(headers: list[tuple[bytes, bytes]]) -> None:
    proxy = Proxy()
    body = json.dumps(BODY).encode()

    proxy.serve(body, headers=headers)

    assert proxy.begun == [] and proxy.dropped == []
    assert proxy.app_body == body


def test_the_digest_covers_all_but_the_headers_that_change_from_call_to_call() -> None:
    digest = request_digest(scope_of(KEY))

    assert request_digest(scope_of([(b"Authorization", b"Bearer sk-known")])) == digest
    for volatile in (b"content-length", b"traceparent", b"x-litellm-call-id", b"x-stainless-retry-count"):
        assert request_digest(scope_of([*KEY, (volatile, b"1")])) == digest, volatile
    for other in (b"x-api-key", b"x-litellm-api-key", b"x-my-auth", b"cookie", b"x-litellm-team-id"):
        assert request_digest(scope_of([*KEY, (other, b"1")])) != digest, other
    assert request_digest(scope_of(KEY, client=("10.0.0.7", 50124))) == digest, "another connection"
    assert request_digest(scope_of(KEY, client=("10.0.0.8", 50123))) != digest
    assert request_digest(scope_of(KEY, query_string=b"key=sk-2")) != digest
    assert request_digest(scope_of([])) != digest


@pytest.mark.parametrize(
    ("body", "extra", "options"),
    [
        (json.dumps(BODY).encode(), [(b"content-encoding", b"gzip")], {}),
        (json.dumps(BODY).encode(), [], {"max_body": 10}),
        (b"{not json", [], {}),
        (b"[1, 2]", [], {}),
    ],
    ids=["compressed", "over max_body", "not JSON", "not an object"],
)
def test_a_body_it_cannot_read_as_plain_json_is_left_to_the_pre_call_hook(
    body: bytes, extra: list[tuple[bytes, bytes]], options: dict[str, Any]
) -> None:
    proxy = Proxy()

    proxy.serve(body, headers=[*KEY, *extra], **options)

    assert proxy.begun == []
    assert proxy.app_body == body


@pytest.mark.parametrize(("method", "path"), [("POST", "/v1/embeddings"), ("GET", "/v1/chat/completions")])
def test_other_routes_pass_through_untouched(method: str, path: str) -> None:
    proxy = Proxy()
    seen: list[object] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(ARRIVAL.get())

    async def receive() -> Message:
        raise AssertionError("the body is the application's to read")

    async def send(message: Message) -> None:
        return None

    stack = AdmitOnArrival(app, callers=proxy.callers, begin=proxy.begin, end=proxy.end)
    asyncio.run(stack(scope_of(KEY, method=method, path=path), receive, send))

    assert seen == [None] and proxy.begun == [] and proxy.events == []


def test_a_failure_to_start_the_admission_leaves_the_request_to_the_pre_call_hook(
    caplog: pytest.LogCaptureFixture,
) -> None:
    proxy = Proxy()

    async def begin(data: dict[str, Any], caller: Caller) -> str:
        raise KeyError("a bug")

    proxy.begin = begin  # type: ignore[method-assign]
    body = json.dumps(BODY).encode()

    proxy.serve(body)

    assert proxy.app_body == body and proxy.taken is None
    assert "could not be started on arrival" in caplog.text


def test_known_callers_are_forgotten_after_their_ttl_and_the_least_recent_beyond_the_size() -> None:
    now = [0.0]
    callers = KnownCallers(ttl_s=60, size=2, monotonic=lambda: now[0])
    callers.remember("a", Caller("team-a"))
    callers.remember("b", Caller("team-b"))
    now[0] = 30
    callers.remember("a", Caller("team-a"))
    now[0] = 40
    callers.remember("c", Caller("team-c"))

    assert callers.get("b") is None, "the least recently seen went beyond the size"
    assert callers.get("a") == Caller("team-a")
    now[0] = 89
    assert callers.get("c") == Caller("team-c")
    assert callers.get("a") == Caller("team-a")
    now[0] = 91
    assert callers.get("a") is None and callers.get("c") == Caller("team-c")


def test_known_callers_can_be_forgotten() -> None:
    callers = KnownCallers(ttl_s=60)
    callers.remember("a", Caller("team-a"))

    callers.forget("a")
    callers.forget("never seen")

    assert callers.get("a") is None


class Layer:
    """A middleware of the chain ``install`` walks: each layer calls ``app``."""

    def __init__(self, app: Any) -> None:
        self.app = app


class FakeProxy:
    """What ``install`` reads of LiteLLM's proxy module: ``app``, its ``router`` and middleware stack."""

    def __init__(self, *, built: bool) -> None:
        self.router = object()
        self.middleware_stack: Any = Layer(Layer(self.router)) if built else None
        self.built = 0

    def build_middleware_stack(self) -> Any:
        self.built += 1
        return Layer(Layer(self.router))

    @property
    def app(self) -> FakeProxy:
        return self


def wrapped(app: Any) -> Any:
    return ("ours", app)


@pytest.mark.parametrize("built", [True, False], ids=["stack built", "stack built later"])
def test_install_puts_the_middleware_right_before_the_routes_once(
    monkeypatch: pytest.MonkeyPatch, built: bool
) -> None:
    proxy = FakeProxy(built=built)
    monkeypatch.setitem(arrival.sys.modules, "litellm.proxy.proxy_server", proxy)

    assert arrival.install(wrapped) and arrival.install(wrapped)

    stack = proxy.middleware_stack if built else proxy.build_middleware_stack()
    assert stack.app.app == ("ours", proxy.router), "behind the middleware, in front of the routes, once"


def test_install_leaves_a_proxy_it_does_not_know_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not arrival.install(wrapped), "not a proxy's process"
    proxy = FakeProxy(built=True)
    proxy.middleware_stack = Layer(Layer(object()))
    monkeypatch.setitem(arrival.sys.modules, "litellm.proxy.proxy_server", proxy)

    assert not arrival.install(wrapped)
    assert proxy.middleware_stack.app.app is not proxy.router
