"""Our REST API from inside the proxy's event loop: one pool of kept-alive connections, one deadline per call.

The proxy serves every request on one asyncio loop, so a call to us must never block it: ``AsyncApi`` is
``httpx2.AsyncClient`` (the openai SDK's HTTP client, so already in the proxy's environment), whose
connections are kept alive and reused: a call costs no TCP (or TLS) handshake. Every ``request`` is
bounded by ONE overall deadline that covers its retries and their back-off: a hung API answers
``ApiUnavailable`` within the deadline, never after attempts × a per-attempt timeout.

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

import httpx2
from tokenbudget_gateway.errors import ApiError, ApiUnavailable, StaleFence
from tokenbudget_gateway.transport import ApiResponse, BaseUrl, RetryPolicy, is_retryable_status

logger = logging.getLogger(__name__)


class AsyncApi:
    """JSON over HTTP to our REST API with a bearer token; see the module docstring.

    ``deadline_s`` bounds each ``request`` whole. ``transport`` replaces httpx2's network transport (tests).
    Raises ``ValueError`` for a base URL that is not http(s).
    """

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        deadline_s: float,
        retry: RetryPolicy | None = None,
        transport: httpx2.AsyncBaseTransport | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rand: Callable[[], float] = random.random,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        BaseUrl.parse(base_url)
        self._base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
        self.deadline_s = deadline_s
        self._retry = retry or RetryPolicy()
        self._transport = transport
        self._sleep = sleep
        self._rand = rand
        self._monotonic = monotonic
        self._client: httpx2.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _http(self) -> httpx2.AsyncClient:
        """The client of the running loop (created on first use: its connections belong to one loop)."""
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:
            self._client = httpx2.AsyncClient(
                base_url=self._base_url,
                headers=self._headers,
                transport=self._transport,
                # The deadline is enforced around each request; this only keeps httpx2 from giving up first.
                timeout=httpx2.Timeout(self.deadline_s),
                limits=httpx2.Limits(max_connections=200, max_keepalive_connections=64, keepalive_expiry=30),
            )
            self._loop = loop
        return self._client

    async def request(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> ApiResponse:
        """Send one call, retrying transient failures with the identical body, all within the deadline.

        Raises ``StaleFence``/``ApiError`` for an error answer, ``ApiUnavailable`` when the deadline passed
        or the retries ran out.
        """
        data = None if body is None else json.dumps(body, separators=(",", ":")).encode()
        sent_headers = {"Content-Type": "application/json"} if data is not None else {}
        sent_headers.update(headers or {})
        deadline = self._monotonic() + self.deadline_s
        cause = "no attempt made"
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
                async with asyncio.timeout(left):
                    answer = await self._http().request(method, path, content=data, headers=sent_headers)
            except TimeoutError:
                cause = f"no answer within the {self.deadline_s:g} s deadline"
                logger.info("%s %s attempt %d: %s", method, path, attempt, cause)
                break
            except (httpx2.HTTPError, OSError) as exc:
                # Refused, reset or a broken exchange: the call may or may not have been applied, and
                # repeating it unchanged is safe because every write is idempotent by its ids.
                cause = f"{type(exc).__name__}: {exc}"
                logger.info("%s %s attempt %d failed: %s", method, path, attempt, cause)
                continue
            parsed = _json_or_none(answer.content)
            if is_retryable_status(answer.status_code, parsed):
                cause = f"HTTP {answer.status_code}"
                continue
            answer_headers = {name.lower(): value for name, value in answer.headers.items()}
            if answer.status_code >= 400:
                problem = parsed if isinstance(parsed, dict) else None
                error = (
                    StaleFence if problem is not None and problem.get("code") == "STALE_FENCE" else ApiError
                )
                raise error(answer.status_code, problem, path, answer_headers.get("retry-after"))
            return ApiResponse(status=answer.status_code, headers=answer_headers, body=parsed)
        raise ApiUnavailable(method, path, cause)

    async def aclose(self) -> None:
        """Close the kept connections."""
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def _json_or_none(raw: bytes) -> Any:
    if not raw:
        return None
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
