"""Our REST API from inside the proxy's event loop: one pool of kept-alive connections, one deadline per call.

The proxy serves every request on one asyncio loop, so a call to us must never block it: ``AsyncApi`` is
an ``aiohttp.ClientSession`` (LiteLLM's own transport to the providers, so already in the proxy's
environment), whose connections are kept alive and reused: a call costs no TCP (or TLS) handshake. It is
not httpx2 (the openai SDK's client) because that is the proxy's CPU on every call's path: about 1.1 ms of
the loop's time per request against 0.2–0.3 ms for aiohttp, measured side by side on this machine (the same
kept-alive POST of a 1 KB body to a loopback server). Every ``request`` is bounded by ONE overall deadline
that covers its retries and their back-off: a hung API answers ``ApiUnavailable`` within the deadline,
never after attempts × a per-attempt timeout.

A caller that wants to go on while the answer is on its way (the hook lets LiteLLM route the call while
its admission is decided) passes ``sent``, an ``asyncio.Event`` set once the request's bytes are handed to
the connection (or the request ended without that): on Python before 3.12, aiohttp writes a body from a
task of its own, so a request coroutine that has merely started may not have sent anything yet.

Retries and what a status means are those of ``tokenbudget_gateway.transport`` (``RetryPolicy``,
``is_retryable_status``): a call is repeated unchanged, which is safe because every write is idempotent by
its ids.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import aiohttp
from tokenbudget_gateway.errors import ApiError, ApiUnavailable, StaleFence
from tokenbudget_gateway.transport import ApiResponse, BaseUrl, RetryPolicy, is_retryable_status

logger = logging.getLogger(__name__)


async def _on_chunk_sent(session: Any, context: Any, params: Any) -> None:
    sent = context.trace_request_ctx.get("sent") if context.trace_request_ctx else None
    if isinstance(sent, asyncio.Event):
        sent.set()


_SENT = aiohttp.TraceConfig()
_SENT.on_request_chunk_sent.append(_on_chunk_sent)


class AsyncApi:
    """JSON over HTTP to our REST API with a bearer token; see the module docstring.

    ``deadline_s`` bounds each ``request`` whole. Raises ``ValueError`` for a base URL that is not http(s).
    """

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        deadline_s: float,
        retry: RetryPolicy | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rand: Callable[[], float] = random.random,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        BaseUrl.parse(base_url)
        self._base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
        self.deadline_s = deadline_s
        self._retry = retry or RetryPolicy()
        self._sleep = sleep
        self._rand = rand
        self._monotonic = monotonic
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _http(self) -> aiohttp.ClientSession:
        """The session of the running loop (created on first use: its connections belong to one loop)."""
        loop = asyncio.get_running_loop()
        if self._session is None or self._loop is not loop:
            self._session = aiohttp.ClientSession(
                headers=self._headers,
                connector=aiohttp.TCPConnector(limit=200, keepalive_timeout=30),
                # The deadline is enforced around each request, retries included.
                timeout=aiohttp.ClientTimeout(total=None),
                # Our API's answers are small JSON documents: no cookies, no compression negotiation.
                cookie_jar=aiohttp.DummyCookieJar(),
                auto_decompress=False,
                skip_auto_headers=("Accept-Encoding",),
                trace_configs=[_SENT],
            )
            self._loop = loop
        return self._session

    async def request(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        *,
        sent: asyncio.Event | None = None,
    ) -> ApiResponse:
        """Send one call, retrying transient failures with the identical body, all within the deadline.

        ``sent`` is set once the request is on the wire, or when this returns or raises (see the module
        docstring). Raises ``StaleFence``/``ApiError`` for an error answer, ``ApiUnavailable`` when the
        deadline passed or the retries ran out (``reached`` false when no attempt got a connection).
        """
        try:
            return await self._request(method, path, body, headers, sent)
        finally:
            if sent is not None:
                sent.set()

    async def _request(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None,
        headers: Mapping[str, str] | None,
        sent: asyncio.Event | None,
    ) -> ApiResponse:
        data = None if body is None else json.dumps(body, separators=(",", ":")).encode()
        sent_headers = {"Content-Type": "application/json"} if data is not None else {}
        sent_headers.update(headers or {})
        deadline = self._monotonic() + self.deadline_s
        cause = "no attempt made"
        reached = False
        for attempt in range(1, self._retry.attempts + 1):
            if attempt > 1:
                pause = self._retry.backoff(attempt - 1, self._rand())
                if self._monotonic() + pause >= deadline:
                    break
                await self._sleep(pause)
            left = deadline - self._monotonic()
            if left <= 0:
                break
            try:
                async with (
                    asyncio.timeout(left),
                    self._http().request(
                        method,
                        self._base_url + path,
                        data=data,
                        headers=sent_headers,
                        trace_request_ctx=None if sent is None else {"sent": sent},
                    ) as answer,
                ):
                    status, content = answer.status, await answer.read()
                    answer_headers = {name.lower(): value for name, value in answer.headers.items()}
            except TimeoutError:
                # The request may have been sent before the deadline cut it short.
                reached = True
                cause = f"no answer within the {self.deadline_s:g} s deadline"
                logger.info("%s %s attempt %d: %s", method, path, attempt, cause)
                break
            except (aiohttp.ClientError, OSError) as exc:
                # Refused, reset or a broken exchange: the call may or may not have been applied, and
                # repeating it unchanged is safe because every write is idempotent by its ids.
                cause = f"{type(exc).__name__}: {exc}"
                # Only a connection that was never made proves nothing was sent.
                reached = reached or not isinstance(exc, aiohttp.ClientConnectorError)
                logger.info("%s %s attempt %d failed: %s", method, path, attempt, cause)
                continue
            parsed = _json_or_none(content)
            if is_retryable_status(status, parsed):
                reached = True
                cause = f"HTTP {status}"
                continue
            if status >= 400:
                problem = parsed if isinstance(parsed, dict) else None
                error = (
                    StaleFence if problem is not None and problem.get("code") == "STALE_FENCE" else ApiError
                )
                raise error(status, problem, path, answer_headers.get("retry-after"))
            return ApiResponse(status=status, headers=answer_headers, body=parsed)
        raise ApiUnavailable(method, path, cause, reached=reached)

    async def aclose(self) -> None:
        """Close the kept connections."""
        if self._session is not None:
            await self._session.close()
            self._session = None


def _json_or_none(raw: bytes) -> Any:
    if not raw:
        return None
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
