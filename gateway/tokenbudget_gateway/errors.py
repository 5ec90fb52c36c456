"""The errors the gateway client raises about our API, the provider, and its own scripted death."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

# What a ``/fail`` may claim: ``"unknown"`` when the provider may or may not have processed the request.
RequestSent = bool | Literal["unknown"]


class GatewayError(Exception):
    """Base of the errors this client raises about our API or the provider."""


class ApiUnavailable(GatewayError):
    """Our API could not be reached (or answered 502/504) after every retry; the outcome is unknown.

    ``reached``: whether any attempt may have reached our API, and so may have been applied. ``False`` only
    when no attempt got a connection (refused, no route): nothing was sent.
    """

    def __init__(self, method: str, path: str, cause: str, *, reached: bool) -> None:
        self.method = method
        self.path = path
        self.cause = cause
        self.reached = reached
        super().__init__(f"{method} {path}: our API is unavailable ({cause})")


class ApiError(GatewayError):
    """Our API answered with an error (problem+json); ``code`` is its machine-readable code and
    ``retry_after`` its ``Retry-After`` header, if any."""

    def __init__(
        self, status: int, problem: Mapping[str, Any] | None, path: str, retry_after: str | None = None
    ) -> None:
        self.status = status
        self.problem: Mapping[str, Any] = problem or {}
        self.code: str | None = (
            self.problem.get("code") if isinstance(self.problem.get("code"), str) else None
        )
        self.path = path
        self.retry_after = retry_after
        super().__init__(f"{path}: HTTP {status} {self.code or ''} {self.problem.get('detail', '')}".rstrip())


class StaleFence(ApiError):
    """409 STALE_FENCE: a reclaimer holds a higher fence; this client must stop writing."""


class AdmissionQueued(GatewayError):
    """202: the admission was queued (PROPOSED); ``body`` has the position and the poll URL."""

    def __init__(self, body: Any) -> None:
        self.body = body
        super().__init__(f"admission queued: {body!r}")


class ProtocolViolation(GatewayError):
    """An answer of our API, or the admitted payload, does not match the contract."""


class ProviderCallError(GatewayError):
    """The provider call failed; ``request_sent`` is what may be claimed in ``/fail``.

    ``False`` only with proof that the provider did not process the request: no byte of the body can
    have left this process (connection refused, or the headers could not be sent), or the provider
    answered with a status that documents non-processing (``provider.NOT_PROCESSED_STATUSES``). ``True`` once
    any other answer began; ``"unknown"`` otherwise (a reset or timeout after the body was sent).
    """

    def __init__(self, reason: str, request_sent: RequestSent, status: int | None = None) -> None:
        self.reason = reason
        self.request_sent = request_sent
        self.status = status
        super().__init__(f"provider call failed: {reason} (requestSent={request_sent})")


class ClientDied(Exception):
    """Raised by the ``die_after`` hook: the client stops with no further call to our API."""
