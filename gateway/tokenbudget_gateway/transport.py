"""JSON over HTTP to our REST API with a bearer token, retrying transient failures with the same body."""

from __future__ import annotations

import http.client
import json
import logging
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from tokenbudget_gateway.errors import ApiError, ApiUnavailable, StaleFence

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently to retry a call to our API. Raises ``ValueError`` if unusable."""

    attempts: int = 4
    base_delay_s: float = 0.1
    max_delay_s: float = 2.0
    jitter: float = 0.2

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError("attempts must be at least 1")
        if self.base_delay_s < 0 or self.max_delay_s < self.base_delay_s:
            raise ValueError("need 0 <= base_delay_s <= max_delay_s")
        if not 0 <= self.jitter <= 1:
            raise ValueError("jitter must be within [0, 1]")

    def backoff(self, retry: int, rand: float) -> float:
        """Seconds to wait before retry number ``retry`` (1-based); ``rand`` in [0, 1) spreads retries."""
        delay = min(self.max_delay_s, self.base_delay_s * 2.0 ** (retry - 1))
        # Jitter only shortens the delay, so max_delay_s stays a real bound.
        return delay * (1 - self.jitter * rand)


def is_retryable_status(status: int, body: Any) -> bool:
    """502/504 from a proxy, and a 503 that carries no problem ``code`` (a load balancer, not our API).

    A 503 with a code (``COUNTING_UNAVAILABLE``) and every 4xx are decisions, not outages.
    """
    if status in (502, 504):
        return True
    return status == 503 and not (isinstance(body, dict) and isinstance(body.get("code"), str))


@dataclass(frozen=True)
class BaseUrl:
    """An http(s) base URL: the host to connect to and the path every request goes under."""

    https: bool
    host: str
    port: int | None
    path: str

    @classmethod
    def parse(cls, base_url: str) -> BaseUrl:
        """Raises ``ValueError`` unless ``base_url`` is an http(s) URL with a host (and a valid port)."""
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"base_url must be an http(s) URL, not {base_url!r}")
        return cls(parts.scheme == "https", parts.hostname, parts.port, parts.path.rstrip("/"))

    def connection(self, timeout_s: float) -> http.client.HTTPConnection:
        """A new connection to the host, not yet connected."""
        if self.https:
            return http.client.HTTPSConnection(self.host, self.port, timeout=timeout_s)
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout_s)


@dataclass(frozen=True)
class ApiResponse:
    """A successful (2xx) answer of our API; ``headers`` have lower-case names."""

    status: int
    headers: Mapping[str, str]
    body: Any


class ApiClient:
    """JSON over HTTP to our REST API with a bearer token, retrying per ``RetryPolicy``."""

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        timeout_s: float = 10.0,
        retry: RetryPolicy | None = None,
        sleep: Callable[[float], None] = time.sleep,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self._base = BaseUrl.parse(base_url)
        self._token = token
        self._timeout_s = timeout_s
        self._retry = retry or RetryPolicy()
        self._sleep = sleep
        self._rand = rand

    def request(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> ApiResponse:
        """Send one call, retrying transient failures with the identical body and headers.

        Raises ``StaleFence``/``ApiError`` for an error answer, ``ApiUnavailable`` when retries ran out
        (``reached`` false when every attempt's connection was refused).
        """
        data = None if body is None else json.dumps(body, separators=(",", ":")).encode()
        sent_headers = {"Authorization": f"Bearer {self._token}", "Accept": "application/json"}
        if data is not None:
            sent_headers["Content-Type"] = "application/json"
        sent_headers.update(headers or {})
        cause = "no attempt made"
        reached = False
        for attempt in range(1, self._retry.attempts + 1):
            if attempt > 1:
                self._sleep(self._retry.backoff(attempt - 1, self._rand()))
            try:
                status, answer_headers, raw = self._exchange(method, path, data, sent_headers)
            except (OSError, http.client.HTTPException) as exc:
                # Refused, reset, timed out or a broken exchange: the call may or may not have been applied,
                # and repeating it unchanged is safe because every write is idempotent by its ids.
                cause = f"{type(exc).__name__}: {exc}"
                # Only a refused connection proves nothing was sent.
                reached = reached or not isinstance(exc, ConnectionRefusedError)
                logger.info("%s %s attempt %d failed: %s", method, path, attempt, cause)
                continue
            parsed = _json_or_none(raw)
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

    def _exchange(
        self, method: str, path: str, data: bytes | None, headers: Mapping[str, str]
    ) -> tuple[int, dict[str, str], bytes]:
        connection = self._base.connection(self._timeout_s)
        try:
            connection.request(method, self._base.path + path, body=data, headers=dict(headers))
            response = connection.getresponse()
            raw = response.read()
            return response.status, {k.lower(): v for k, v in response.getheaders()}, raw
        finally:
            connection.close()


def _json_or_none(raw: bytes) -> Any:
    if not raw:
        return None
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
