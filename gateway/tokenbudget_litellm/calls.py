"""The admission protocol (SPEC §5, §8) for one call through the proxy, and what a failed call may claim.

``Calls`` makes the calls to our API, as coroutines of the proxy's event loop: admit (waiting out a queue
up to ``queue_wait_s``, and recording the dispatch in the same call), dispatch (only where the admission
could not record it), the final usage (sent with other calls' final usages: ``reports``), ``fail``,
``cancel``, lease renewals. A ``Ticket`` is what an admission grants and what the later hooks need; it rides
in the request's metadata. Our API's refusals become ``Refusal``s carrying the status, the problem and
``Retry-After`` the proxy's client must see; an unreachable API raises ``ApiUnavailable`` and the hook
decides (fail closed, or open if configured).

``request_sent_of`` says what ``/fail`` may claim about a failed provider call: ``False`` only with proof
of non-processing (the provider answered a status that documents it, or refused the connection),
``True`` once the provider answered otherwise or streamed a chunk, ``"unknown"`` for the rest (a reset,
a timeout, an error raised before we can tell whether anything was sent).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final, Protocol
from urllib.parse import quote

from tokenbudget_gateway.errors import (
    ApiError,
    ApiUnavailable,
    GatewayError,
    ProtocolViolation,
    RequestSent,
)
from tokenbudget_gateway.protocol import (
    ADMISSIONS_PATH,
    Grant,
    is_int,
    parse_time,
    provider_request_id_for,
    provider_request_id_of_key,
    usage_event_id,
)
from tokenbudget_gateway.provider import NOT_PROCESSED_STATUSES
from tokenbudget_gateway.transport import ApiResponse

from tokenbudget_litellm.mapping import AdmissionRequest
from tokenbudget_litellm.reports import UsageReports

logger = logging.getLogger(__name__)

# Our API's identifier pattern: a provider id that does not fit is not used in usage event ids.
_IDENTIFIER: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/-]{0,180}")
_MAX_REASON: Final = 300
WITHDRAWN: Final = "admission given up by the gateway: no provider call was made"


class Refusal(Exception):
    """What the proxy's client gets instead of a completion: ``status``, our ``problem`` (with its
    ``code``) and ``retry_after`` (seconds, as our API sent it)."""

    def __init__(self, status: int, problem: Mapping[str, Any], retry_after: str | None = None) -> None:
        self.status = status
        self.problem = dict(problem)
        self.code = str(self.problem.get("code") or "ADMISSION_REFUSED")
        self.retry_after = retry_after
        super().__init__(f"HTTP {status} {self.code}: {self.problem.get('detail', '')}")

    @classmethod
    def of(cls, status: int, code: str, detail: str, retry_after: str | None = None) -> Refusal:
        """A refusal the hook itself decides, in our problem's shape."""
        return cls(status, {"status": status, "code": code, "detail": detail}, retry_after)


@dataclass(frozen=True)
class Ticket:
    """An admitted call: what the later hooks need to dispatch and settle it.

    ``dispatched``: the admission itself recorded the dispatch (no ``/dispatch`` call is needed).
    ``model_revision``: the revision the call was admitted on (a fallback rung names another).
    ``lease_s``: the granted lease, in seconds from when the grant arrived.
    """

    reservation_id: str
    fence: int
    admitted_digest: str
    provider_request_id: str
    max_output: int
    rung: str
    model_revision: str = ""
    lease_s: float = 0.0
    dispatched: bool = False

    def to_metadata(self) -> dict[str, Any]:
        return {
            "reservationId": self.reservation_id,
            "fence": self.fence,
            "admittedDigest": self.admitted_digest,
            "providerRequestId": self.provider_request_id,
            "maxOutput": self.max_output,
            "rung": self.rung,
            "modelRevision": self.model_revision,
            "leaseSeconds": self.lease_s,
            "dispatched": self.dispatched,
        }

    @classmethod
    def from_metadata(cls, value: Any) -> Ticket | None:
        """The ticket a request carries, or ``None`` (not admitted by this hook, or a malformed value)."""
        if not isinstance(value, Mapping):
            return None
        try:
            ticket = cls(
                reservation_id=value["reservationId"],
                fence=value["fence"],
                admitted_digest=value["admittedDigest"],
                provider_request_id=value["providerRequestId"],
                max_output=value["maxOutput"],
                rung=value["rung"],
                model_revision=value.get("modelRevision", ""),
                lease_s=value.get("leaseSeconds", 0.0),
                dispatched=value.get("dispatched", False),
            )
        except KeyError:
            return None
        return ticket if is_int(ticket.fence) and isinstance(ticket.reservation_id, str) else None


@dataclass(frozen=True)
class Admitted:
    """The admission's answer: a ``ticket`` and the ``payload`` to send, or ``shadow`` (nothing held, the
    request goes unchanged)."""

    ticket: Ticket | None
    payload: Any
    shadow: bool = False


class Api(Protocol):
    """What ``Calls`` needs of our API: ``tokenbudget_litellm.transport.AsyncApi``."""

    async def request(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        *,
        sent: asyncio.Event | None = None,
    ) -> ApiResponse: ...


class Calls:
    """Our API's side of one proxied call; every method is a coroutine of the proxy's event loop.

    ``dispatch_at_admission``: the admission also records the dispatch under a provider request id the hook
    makes up (``provider_request_id_of``), so no call to us stands between the admission and the provider
    call; without it (or for a queued admission, which the queue admits undispatched) ``dispatch`` does.
    """

    def __init__(
        self,
        api: Api,
        *,
        queue_wait_s: float = 0.0,
        dispatch_at_admission: bool = True,
        usage_flush_s: float = 0.0,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        monotonic: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self._api = api
        self._queue_wait_s = queue_wait_s
        self._dispatch_at_admission = dispatch_at_admission
        self._sleep = sleep
        self._monotonic = monotonic
        self._wall_clock = wall_clock
        self.reports = UsageReports(api, flush_s=usage_flush_s, monotonic=monotonic)

    async def admit(self, request: AdmissionRequest, *, sent: asyncio.Event | None = None) -> Admitted:
        """``POST /api/v1/admissions``; a queued answer is asked again with the same key until admitted
        or ``queue_wait_s`` has passed (then the queued reservation is cancelled and 429 ``QUEUED``).
        ``sent`` is set once the first ask is on the wire (``AsyncApi.request``).

        Raises ``Refusal`` for our API's rejections, ``ApiUnavailable``/``ProtocolViolation`` otherwise.
        """
        provider_request_id = provider_request_id_of(request) if self._dispatch_at_admission else None
        deadline = self._monotonic() + self._queue_wait_s
        queued = False
        while True:
            try:
                response = await self._post_admission(request, provider_request_id, sent)
            except ApiUnavailable as exc:
                if queued and not exc.reached:
                    # An earlier answer queued the admission: our API holds it, whatever this attempt proves.
                    raise ApiUnavailable(exc.method, exc.path, exc.cause, reached=True) from exc
                raise
            if response.status != 202:
                return self._admitted(response, provider_request_id)
            queued = True
            retry_after = _seconds(response.headers.get("retry-after"), default=2.0)
            left = deadline - self._monotonic()
            if left <= 0:
                await self._give_up_queued(response.body)
                raise Refusal.of(
                    429,
                    "QUEUED",
                    "no capacity now: the admission was queued and did not clear in time",
                    response.headers.get("retry-after"),
                )
            await self._sleep(min(retry_after, left))

    async def withdraw(self, request: AdmissionRequest) -> str | None:
        """Release an admission this hook gave up waiting for: our API may have granted it all the same.

        Asked again with the same key and body, the first answer stands (or, if the first never arrived,
        it is granted now); no provider call was made for it, so what it holds is released in full.
        Returns the id of the reservation released (``None``: a refusal or a shadow answer held nothing).
        Raises ``GatewayError`` if our API is still unreachable: the lease then expires and the reclaimer
        releases it.
        """
        provider_request_id = provider_request_id_of(request) if self._dispatch_at_admission else None
        try:
            response = await self._post_admission(request, provider_request_id)
        except Refusal:
            return None
        if response.status == 202:
            await self._give_up_queued(response.body)
            queued = response.body.get("reservationId") if isinstance(response.body, dict) else None
            return queued if isinstance(queued, str) else None
        ticket = self._admitted(response, provider_request_id).ticket
        if ticket is None:
            return None
        if ticket.dispatched:
            await self.fail(ticket, request_sent=False, reason=WITHDRAWN)
        else:
            await self.cancel(ticket)
        return ticket.reservation_id

    async def dispatch(self, ticket: Ticket) -> None:
        """Record the dispatch; raises ``GatewayError`` (``StaleFence`` included) if it was not recorded."""
        await self._post(
            ticket,
            "dispatch",
            {"providerRequestId": ticket.provider_request_id, "admittedDigest": ticket.admitted_digest},
        )

    def complete(
        self, ticket: Ticket, *, input_tokens: int, output_tokens: int, provider_id: str | None
    ) -> None:
        """The final usage: the provider's totals for the call, in one event, sent with other calls' within
        ``usage_flush_s`` (``reports``)."""
        self.reports.add(
            {
                "reservationId": ticket.reservation_id,
                "fence": ticket.fence,
                "usageEventId": _event_id(ticket, provider_id, 1),
                "inputTokens": input_tokens,
                "outputTokens": output_tokens,
                "final": True,
            }
        )

    async def fail(
        self, ticket: Ticket, *, request_sent: RequestSent, reason: str, output_seen: int = 0
    ) -> None:
        """``/fail``; ``output_seen`` (tokens the stream delivered) is posted with it as incurred usage."""
        body: dict[str, Any] = {"reason": reason[:_MAX_REASON], "requestSent": request_sent}
        if output_seen:
            body["usage"] = {"usageEventId": _event_id(ticket, None, 1), "outputTokens": output_seen}
        await self._post(ticket, "fail", body)

    async def cancel(self, ticket: Ticket, *, output_seen: int = 0) -> None:
        """``/cancel``, after posting what the stream delivered so far as incurred usage."""
        if output_seen:
            await self._post(
                ticket,
                "usage",
                {"usageEventId": _event_id(ticket, None, 1), "outputTokens": output_seen, "final": False},
            )
        await self._post(ticket, "cancel", {})

    async def renew(self, ticket: Ticket) -> float | None:
        """``/lease``: the lease's new length in seconds from now (``None`` if the answer does not say).
        Raises ``GatewayError`` (``StaleFence`` once a reclaimer took the lease over)."""
        response = await self._post(ticket, "lease", {})
        return self._lease_seconds(response.body)

    async def _post_admission(
        self, request: AdmissionRequest, provider_request_id: str | None, sent: asyncio.Event | None = None
    ) -> ApiResponse:
        headers = {"Idempotency-Key": request.idempotency_key}
        if request.traceparent:
            headers["traceparent"] = request.traceparent
        body = request.body
        if provider_request_id is not None:
            body = {**body, "dispatch": {"providerRequestId": provider_request_id}}
        try:
            return await self._api.request("POST", ADMISSIONS_PATH, body, headers, sent=sent)
        except ApiError as exc:
            # Our 5xx are outages as far as the proxy's client is concerned: retry later. A 404 is a
            # tenant, task class or pool this API does not know: the request, not a missing route.
            status = 503 if exc.status >= 500 else 400 if exc.status == 404 else exc.status
            raise Refusal(status, exc.problem or {"code": "ADMISSION_FAILED"}, exc.retry_after) from exc

    def _admitted(self, response: ApiResponse, provider_request_id: str | None) -> Admitted:
        body = response.body if isinstance(response.body, dict) else {}
        if body.get("mode") == "SHADOW":
            return Admitted(ticket=None, payload=None, shadow=True)
        grant = Grant.from_response(response)
        dispatched = body.get("state") == "DISPATCHED" and provider_request_id is not None
        revision = body.get("modelRevision")
        ticket = Ticket(
            reservation_id=grant.reservation_id,
            fence=grant.fence,
            admitted_digest=grant.admitted_digest,
            provider_request_id=str(body.get("providerRequestId") or provider_request_id)
            if dispatched
            else provider_request_id_for(grant.reservation_id),
            max_output=grant.max_output,
            rung=grant.rung,
            model_revision=revision if isinstance(revision, str) else "",
            lease_s=self._lease_seconds(body) or 0.0,
            dispatched=dispatched,
        )
        return Admitted(ticket=ticket, payload=grant.payload)

    def _lease_seconds(self, body: Any) -> float | None:
        lease = body.get("lease") if isinstance(body, dict) else None
        expires = lease.get("expiresAt") if isinstance(lease, dict) else None
        try:
            return (parse_time(expires) - self._wall_clock()).total_seconds()
        except ValueError:
            return None

    async def _give_up_queued(self, body: Any) -> None:
        """Cancel a queued reservation we stop waiting for, so it is never admitted for nobody."""
        reservation_id = body.get("reservationId") if isinstance(body, dict) else None
        if not isinstance(reservation_id, str):
            return
        path = f"/api/v1/reservations/{quote(reservation_id, safe='')}"
        try:
            current = (await self._api.request("GET", path)).body
            lease = current.get("lease") if isinstance(current, dict) else None
            fence = lease.get("fence") if isinstance(lease, dict) else None
            if not is_int(fence):
                raise ProtocolViolation("the queued reservation shows no fence")
            await self._api.request("POST", f"{path}/cancel", {"fence": fence})
        except GatewayError:
            # Left queued, it is admitted or rejected by its deadline; admitted and never dispatched, its
            # lease expires and it is released in full.
            logger.warning("could not cancel queued reservation %s", reservation_id, exc_info=True)

    async def _post(self, ticket: Ticket, action: str, body: Mapping[str, Any]) -> ApiResponse:
        path = f"/api/v1/reservations/{quote(ticket.reservation_id, safe='')}/{action}"
        return await self._api.request("POST", path, {"fence": ticket.fence, **body})


def may_have_reached_our_api(error: BaseException) -> bool:
    """Whether a call that failed with ``error`` may have reached our API (and so may have been applied):
    not when no attempt got a connection. An admission that may have reached it is withdrawn."""
    return not (isinstance(error, ApiUnavailable) and not error.reached)


def provider_request_id_of(request: AdmissionRequest) -> str:
    """The provider request id an admission dispatches under: derived from its ``Idempotency-Key`` (a name
    UUID), so a repeated admission names the same id and the first answer stands."""
    return provider_request_id_of_key(request.idempotency_key)


def request_sent_of(error: BaseException, chunks_seen: int = 0) -> RequestSent:
    """What a failed provider call may claim in ``requestSent`` (see the module docstring)."""
    if chunks_seen > 0:
        return True
    for cause in _causes(error):
        status = _answered_status(cause)
        if status is not None:
            return status not in NOT_PROCESSED_STATUSES
        if isinstance(cause, ConnectionRefusedError):
            return False
    return "unknown"


def failure_reason(error: BaseException) -> str:
    """A short reason for ``/fail``: the provider's status if it answered, else the error's kind."""
    for cause in _causes(error):
        status = _answered_status(cause)
        if status is not None:
            return f"provider_http_{status}: {type(error).__name__}"
    return f"{type(error).__name__}: {error}"[:_MAX_REASON]


def _causes(error: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _answered_status(error: BaseException) -> int | None:
    """The HTTP status of a provider answer this error wraps, if it is one.

    Only errors the HTTP clients raise for a received answer count (httpx's ``HTTPStatusError``, the
    OpenAI SDK's ``APIStatusError``): LiteLLM's own exceptions carry a status even for a connection
    error, so their ``status_code`` proves nothing. Some of them subclass the OpenAI SDK's
    (``litellm.InternalServerError`` is an ``APIStatusError`` with a made-up 500 for a reset connection):
    none of LiteLLM's counts, only the error it wraps.
    """
    if type(error).__module__.partition(".")[0] == "litellm":
        return None
    names = {klass.__name__ for klass in type(error).__mro__}
    if not names & {"HTTPStatusError", "APIStatusError"}:
        return None
    status = getattr(getattr(error, "response", None), "status_code", None)
    return status if is_int(status) else None


def _event_id(ticket: Ticket, provider_id: str | None, seq: int) -> str:
    """A usage event id from the provider's request id (the dispatched one unless the answer named a
    usable one)."""
    name = provider_id if provider_id and _IDENTIFIER.fullmatch(provider_id) else ticket.provider_request_id
    return usage_event_id(name, seq)


def _seconds(value: str | None, *, default: float) -> float:
    try:
        return max(0.0, float(value)) if value is not None else default
    except ValueError:
        return default
