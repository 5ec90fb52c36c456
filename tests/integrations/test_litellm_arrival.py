"""The admission asked for as a request arrives at the proxy (``tokenbudget_litellm.arrival``): the middleware
against an application standing in for LiteLLM's on a real event loop (no LiteLLM, no database); through a
real LiteLLM proxy, in ``test_litellm_arrival_proxy``."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from tokenbudget_litellm.arrival import ARRIVAL, AdmitOnArrival, KnownCallers, Message, credentials_digest
from tokenbudget_litellm.mapping import Caller

KEY = [(b"authorization", b"Bearer sk-known")]
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
            self.callers.remember(credentials_digest(KEY), TEAM)
        self._take = take
        self._fail = fail

    async def begin(self, data: dict[str, Any], caller: Caller) -> str:
        self.events.append("admission started")
        self.begun.append((data, caller))
        return f"early-{len(self.begun)}"

    def drop(self, early: str) -> None:
        self.events.append("admission dropped")
        self.dropped.append(early)

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

        scope = {"type": "http", "method": "POST", "path": path, "headers": sent_headers}
        stack = AdmitOnArrival(self.app, callers=self.callers, begin=self.begin, drop=self.drop, **middleware)
        asyncio.run(stack(scope, receive, send))


def test_a_known_callers_request_is_admitted_before_the_application_runs_and_reaches_it_unchanged() -> None:
    proxy = Proxy()
    body = json.dumps(BODY).encode()

    proxy.serve(body, chunk=7)

    assert proxy.events == ["admission started", "application started"]
    [(data, caller)] = proxy.begun
    assert caller == TEAM
    call_id = proxy.app_headers[b"x-litellm-call-id"].decode()
    assert data == {**BODY, "litellm_call_id": call_id}
    assert proxy.app_body == body
    assert proxy.taken == "early-1" and proxy.dropped == []


def test_the_callers_own_call_id_and_traceparent_are_the_admissions() -> None:
    proxy = Proxy()
    trace = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

    proxy.serve(
        json.dumps(BODY).encode(),
        headers=[*KEY, (b"X-LiteLLM-Call-Id", b"call-42"), (b"traceparent", trace)],
    )

    [(data, _)] = proxy.begun
    assert data["litellm_call_id"] == "call-42"
    assert data["proxy_server_request"] == {"headers": {"traceparent": trace.decode()}}
    assert b"x-litellm-call-id" not in proxy.app_headers, "nothing is added to a request that has one"


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

    assert proxy.events == ["admission started", "application started", "admission dropped"]
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
    assert proxy.app_body == body and b"x-litellm-call-id" not in proxy.app_headers


def test_the_credential_digest_covers_every_header_that_may_carry_a_key_and_only_those() -> None:
    digest = credentials_digest(KEY)

    assert credentials_digest([(b"Authorization", b"Bearer sk-known")]) == digest
    assert credentials_digest([*KEY, (b"user-agent", b"openai-python")]) == digest
    for name in (b"api-key", b"x-api-key", b"x-goog-api-key", b"x-litellm-api-key", b"x-custom-token"):
        assert credentials_digest([*KEY, (name, b"sk-1")]) != digest, name


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

    stack = AdmitOnArrival(app, callers=proxy.callers, begin=proxy.begin, drop=proxy.drop)
    scope = {"type": "http", "method": method, "path": path, "headers": KEY}
    asyncio.run(stack(scope, receive, send))

    assert seen == [None] and proxy.begun == []


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
