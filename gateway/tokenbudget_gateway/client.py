"""A gateway client that performs the admission protocol (SPEC §5, §8) around one streamed provider call.

The order is the protocol:

1. ``POST /api/v1/admissions`` with an ``Idempotency-Key``; a 201 (or a 200 replay) grants a reservation,
   the exact ``payload`` to send, its ``admittedDigest`` and a lease ``fence``. By default
   (``dispatch_at_admission``) the admission also records the dispatch, under a ``providerRequestId``
   derived from the ``Idempotency-Key`` (``dispatch: {providerRequestId}``): one call to our API precedes
   the provider call, and a repeated admission names the same id.
2. Otherwise (``dispatch_at_admission=False``, or a server that answered the reservation undispatched)
   ``POST …/dispatch {fence, providerRequestId, admittedDigest}`` **before** any byte goes to the provider,
   ``providerRequestId`` derived from the reservation id. Either way a crash after the provider call can
   always be traced to a recorded dispatch, and every attempt and the reconciler's lookups use the same id.
   What nothing was sent for is released in full: ``/cancel`` before the dispatch is recorded, ``/fail``
   with ``requestSent: false`` after.
3. Stream from the provider (OpenAI Chat Completions, ``include_usage``), posting usage deltas
   ``POST …/usage {fence, usageEventId, outputTokens, final: false}`` every N content chunks and renewing
   the lease ``POST …/lease {fence}``; then the final usage ``{inputTokens, outputTokens, final: true}``.
4. On a provider failure ``POST …/fail {fence, reason, requestSent}``; on the caller's cancel
   ``POST …/cancel {fence}``. Usage seen before either is posted first, through ``/usage``.
   ``requestSent`` is ``false`` only with proof of non-processing: the connection was refused before any
   byte, or the provider answered 400/401/403/404/429 (``reason`` ``provider_http_<status>: <type>``), and
   our API then releases the reservation in full; a reset or timeout after the body went out is
   ``"unknown"``; any other answer is ``true``.

Mid-stream deltas are a lower bound of what the provider bills — the larger of the number of content
chunks (each carries at least one token) and the largest cumulative per-chunk usage the provider reported —
so the final delta (provider total minus what was posted) is never negative. Usage values are treated as
cumulative and only their maximum is used, so duplicated or reordered usage chunks cannot double count.

Every call to our API is retried on connection errors and gateway timeouts with the same body, so the
same idempotency key, ``usageEventId`` and fence: the server applies each at most once. A usage event
that could not be delivered is re-sent unchanged before any newer one, never folded into a new id.

``die_after`` makes the client stop dead at a chosen point (raising ``ClientDied`` and making no further
call to our API) so fault tests can leave reservations exactly where a crashed gateway would; ``pause_at``
calls back at a point and carries on when the callback returns, as a gateway frozen by a long GC pause or
a stopped VM would.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final, Literal
from urllib.parse import quote

from tokenbudget_gateway.errors import (
    AdmissionQueued,
    ApiUnavailable,
    ClientDied,
    GatewayError,
    ProtocolViolation,
    ProviderCallError,
    RequestSent,
    StaleFence,
)
from tokenbudget_gateway.protocol import (
    ADMISSIONS_PATH,
    CallOutcome,
    CallResult,
    Grant,
    parse_time,
    provider_request_id_for,
    provider_request_id_of_key,
    usage_event_id,
)
from tokenbudget_gateway.provider import ChatProvider, ChatStream, ProviderUsage, provider_body
from tokenbudget_gateway.transport import ApiClient, ApiResponse

logger = logging.getLogger(__name__)

DiePoint = Literal["before_dispatch", "dispatch", "after_k_chunks", "before_final_usage"]
PausePoint = Literal["before_dispatch", "dispatch", "before_final_usage"]

_MIN_RENEW_INTERVAL_S: Final = 0.05


class GatewayClient:
    """Runs one admitted provider call end to end against our API and an OpenAI-compatible provider.

    ``usage_every_chunks``: post a usage delta every N content chunks. ``lease_renew_interval_s``: renew
    the lease this often; by default a third of the lease's remaining time at admission.
    ``dispatch_at_admission``: the admission records the dispatch (one call to us before the provider call);
    off, the dispatch is a call of its own.

    The lease is renewed between chunks, not from a background thread: a stream stalled for longer than the
    lease loses it, a reclaimer takes over with a higher fence and this client's next write is refused
    (``StaleFence``). Correctness rests on the fence, so the simpler single-threaded client is enough.
    """

    def __init__(
        self,
        api: ApiClient,
        provider: ChatProvider,
        *,
        model: str | None = None,
        usage_every_chunks: int = 8,
        lease_renew_interval_s: float | None = None,
        dispatch_at_admission: bool = True,
        monotonic: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        if usage_every_chunks < 1:
            raise ValueError("usage_every_chunks must be positive")
        self._api = api
        self._provider = provider
        self._model = model
        self._usage_every = usage_every_chunks
        self._renew_interval_s = lease_renew_interval_s
        self._dispatch_at_admission = dispatch_at_admission
        self._monotonic = monotonic
        self._wall_clock = wall_clock

    def admit(self, request: Mapping[str, Any], idempotency_key: str) -> Grant:
        """``POST /api/v1/admissions`` (with ``dispatch_at_admission``, recording the dispatch under the
        provider request id derived from ``idempotency_key``). Raises ``AdmissionQueued`` on 202,
        ``ApiError`` on a rejection, ``ApiUnavailable`` and ``ProtocolViolation`` as their names say."""
        if self._dispatch_at_admission and "dispatch" not in request:
            request = {
                **request,
                "dispatch": {"providerRequestId": provider_request_id_of_key(idempotency_key)},
            }
        response = self._api.request("POST", ADMISSIONS_PATH, request, {"Idempotency-Key": idempotency_key})
        if response.status == 202:
            raise AdmissionQueued(response.body)
        if response.status not in (200, 201):
            raise ProtocolViolation(f"admission answered HTTP {response.status}")
        return Grant.from_response(response)

    def run(
        self,
        request: Mapping[str, Any],
        *,
        idempotency_key: str,
        cancel: threading.Event | None = None,
        die_after: DiePoint | None = None,
        die_after_chunks: int = 0,
        pause_at: Callable[[PausePoint], None] | None = None,
    ) -> CallResult:
        """Admit, dispatch, stream and settle one call; see the module docstring for the protocol.

        Raises what ``admit`` raises, then what ``call`` raises; the keyword arguments are ``call``'s.
        """
        if die_after_chunks < 0:
            raise ValueError("die_after_chunks cannot be negative")
        return self.call(
            self.admit(request, idempotency_key),
            cancel=cancel,
            die_after=die_after,
            die_after_chunks=die_after_chunks,
            pause_at=pause_at,
        )

    def call(
        self,
        grant: Grant,
        *,
        cancel: threading.Event | None = None,
        die_after: DiePoint | None = None,
        die_after_chunks: int = 0,
        pause_at: Callable[[PausePoint], None] | None = None,
    ) -> CallResult:
        """Dispatch, stream and settle the call an admission granted.

        ``cancel`` is checked before dispatch and after every chunk. ``die_after`` raises ``ClientDied`` at
        that point (``after_k_chunks`` after ``die_after_chunks`` content chunks, 0 = as the response
        begins). ``pause_at`` is called at each ``PausePoint`` before the ``die_after`` check there; the
        call goes on when it returns. Raises ``StaleFence`` if the lease was taken over;
        ``ApiError``/``ApiUnavailable`` if dispatch could not be recorded (nothing is then sent to the
        provider, and a best-effort ``/cancel`` is made), or if a later write was refused;
        ``ProtocolViolation`` for a bad payload; ``ValueError`` for a negative ``die_after_chunks``.
        """
        if die_after_chunks < 0:
            raise ValueError("die_after_chunks cannot be negative")
        call = _Call(self, grant)
        # Built before dispatch: a payload we cannot send must not leave a dispatched reservation behind.
        try:
            body = provider_body(grant.payload, grant.max_output, self._model)
        except ProtocolViolation:
            with contextlib.suppress(GatewayError):
                call.release("the admitted payload cannot be sent")
            raise
        if pause_at is not None:
            pause_at("before_dispatch")
        if die_after == "before_dispatch":
            raise ClientDied("before_dispatch")
        if cancel is not None and cancel.is_set():
            return call.terminal(
                *call.release_body("cancelled before dispatch"),
                outcome="cancelled",
                reason="cancelled before dispatch",
            )
        if grant.dispatched_as is None:
            call.dispatch()
        if pause_at is not None:
            pause_at("dispatch")
        if die_after == "dispatch":
            raise ClientDied("after dispatch")
        call.maybe_renew()
        try:
            stream = self._provider.open(body, call.provider_request_id)
        except ProviderCallError as exc:
            return call.fail(exc.request_sent, exc.reason)
        with stream:
            return call.consume(stream, cancel, die_after, die_after_chunks, pause_at)


@dataclass
class _Call:
    """The mutable state of one run: ids, what was reported, the lease clock."""

    client: GatewayClient
    grant: Grant
    provider_request_id: str = field(init=False)
    renew_every_s: float = field(init=False)
    last_renewed: float = field(init=False)
    reported_output: int = 0  # tokens in every usage event created, delivered or still in the outbox
    seq: int = 0
    outbox: list[dict[str, Any]] = field(default_factory=list)
    delivered: int = 0
    content: list[str] = field(default_factory=list)
    input_tokens: int | None = None

    def __post_init__(self) -> None:
        self.provider_request_id = self.grant.dispatched_as or provider_request_id_for(
            self.grant.reservation_id
        )
        self.last_renewed = self.client._monotonic()
        self.renew_every_s = self._renew_interval(self.grant.lease_expires_at)

    @property
    def path(self) -> str:
        return f"/api/v1/reservations/{quote(self.grant.reservation_id, safe='')}"

    def post(self, action: str, body: Mapping[str, Any]) -> ApiResponse:
        return self.client._api.request("POST", f"{self.path}/{action}", {"fence": self.grant.fence, **body})

    def release_body(self, reason: str) -> tuple[Literal["fail", "cancel"], dict[str, Any]]:
        """The call that releases in full what nothing was sent for: ``cancel``, or once the dispatch is
        recorded (by the admission), ``fail`` with ``requestSent: false``."""
        if self.grant.dispatched_as is None:
            return "cancel", {}
        return "fail", {"reason": reason, "requestSent": False}

    def release(self, reason: str) -> None:
        self.post(*self.release_body(reason))

    def dispatch(self) -> None:
        try:
            self.post(
                "dispatch",
                {"providerRequestId": self.provider_request_id, "admittedDigest": self.grant.admitted_digest},
            )
        except StaleFence:
            raise
        except GatewayError:
            # Nothing was sent to the provider, so a full release is right. If this cancel fails too, the
            # lease expires and the reclaimer reaches the same result (the provider lookup finds nothing).
            with contextlib.suppress(GatewayError):
                self.post("cancel", {})
            raise

    def consume(
        self,
        stream: ChatStream,
        cancel: threading.Event | None,
        die_after: DiePoint | None,
        die_after_chunks: int,
        pause_at: Callable[[PausePoint], None] | None,
    ) -> CallResult:
        if die_after == "after_k_chunks" and die_after_chunks == 0:
            raise ClientDied("as the response began")
        chunks = 0
        usage_high = 0
        final: ProviderUsage | None = None
        try:
            for chunk in stream:
                if chunk.usage is not None:
                    self.input_tokens = chunk.usage.prompt_tokens
                    usage_high = max(usage_high, chunk.usage.completion_tokens)
                    if chunk.is_usage_chunk and (
                        final is None or chunk.usage.completion_tokens > final.completion_tokens
                    ):
                        final = chunk.usage
                if chunk.text:
                    chunks += 1
                    self.content.append(chunk.text)
                    if chunks % self.client._usage_every == 0:
                        self.report(max(chunks, usage_high), tolerate_outage=True)
                    if die_after == "after_k_chunks" and chunks == die_after_chunks:
                        raise ClientDied(f"after {chunks} chunks")
                self.maybe_renew()
                if cancel is not None and cancel.is_set():
                    # Closing first stops the provider generating (and billing) more.
                    stream.close()
                    return self.settle_partial(max(chunks, usage_high), "cancel", {}, "cancelled", None)
        except ProviderCallError as exc:
            return self.settle_partial(
                max(chunks, usage_high), "fail", {"reason": exc.reason, "requestSent": True}, "failed", exc
            )
        if final is None:
            return self.settle_partial(
                max(chunks, usage_high),
                "fail",
                {"reason": "missing_final_usage", "requestSent": True},
                "usage_unknown",
                None,
            )
        if pause_at is not None:
            pause_at("before_final_usage")
        if die_after == "before_final_usage":
            raise ClientDied("before final usage")
        if final.completion_tokens < self.reported_output:
            # Cannot happen while mid-stream reports are lower bounds; a provider that under-reports its
            # own total leaves the difference captured, and the server's audit sees the deviation.
            logger.warning(
                "provider total %d below the %d tokens already reported for %s",
                final.completion_tokens,
                self.reported_output,
                self.provider_request_id,
            )
        self.input_tokens = final.prompt_tokens
        try:
            self.report(final.completion_tokens, final=True)
        except ApiUnavailable as exc:
            return self.result("unsettled", reason=str(exc))
        return self.result("completed")

    def report(self, observed: int, *, final: bool = False, tolerate_outage: bool = False) -> None:
        """Queue a delta up to ``observed`` (if any, or always when final) and deliver the outbox in order."""
        delta = max(0, observed - self.reported_output)
        if delta or final:
            self.seq += 1
            event: dict[str, Any] = {
                "usageEventId": usage_event_id(self.provider_request_id, self.seq),
                "outputTokens": delta,
                "final": final,
            }
            if final and self.input_tokens is not None:
                event["inputTokens"] = self.input_tokens
            self.outbox.append(event)
            self.reported_output += delta
        while self.outbox:
            try:
                self.post("usage", self.outbox[0])
            except ApiUnavailable:
                if tolerate_outage:
                    return
                raise
            self.outbox.pop(0)
            self.delivered += 1

    def settle_partial(
        self,
        observed: int,
        action: Literal["fail", "cancel"],
        body: Mapping[str, Any],
        outcome: CallOutcome,
        error: ProviderCallError | None,
    ) -> CallResult:
        try:
            self.report(observed)
        except ApiUnavailable as exc:
            return self.result("unsettled", request_sent=body.get("requestSent"), reason=str(exc))
        reason = error.reason if error is not None else body.get("reason", "cancelled")
        return self.terminal(
            action, body, outcome=outcome, reason=reason, request_sent=body.get("requestSent")
        )

    def fail(self, request_sent: RequestSent, reason: str) -> CallResult:
        return self.terminal(
            "fail",
            {"reason": reason, "requestSent": request_sent},
            outcome="failed",
            reason=reason,
            request_sent=request_sent,
        )

    def terminal(
        self,
        action: Literal["fail", "cancel"],
        body: Mapping[str, Any],
        *,
        outcome: CallOutcome,
        reason: str | None,
        request_sent: RequestSent | None = None,
    ) -> CallResult:
        try:
            self.post(action, body)
        except ApiUnavailable as exc:
            return self.result("unsettled", request_sent=request_sent, reason=f"{reason}; {exc}")
        return self.result(outcome, request_sent=request_sent, reason=reason)

    def maybe_renew(self) -> None:
        if self.client._monotonic() - self.last_renewed < self.renew_every_s:
            return
        try:
            response = self.post("lease", {})
        except ApiUnavailable:
            # Try again after the next chunk; if the lease lapses meanwhile the fence protects the ledger.
            return
        self.last_renewed = self.client._monotonic()
        body = response.body if isinstance(response.body, dict) else {}
        lease = body.get("lease")
        expires_at = (lease if isinstance(lease, dict) else body).get("expiresAt")
        # The renewal's answer shape beyond the fence is not part of the contract; without a new expiry the
        # current interval stays.
        with contextlib.suppress(ValueError):
            self.renew_every_s = self._renew_interval(parse_time(expires_at))

    def _renew_interval(self, expires_at: datetime) -> float:
        if self.client._renew_interval_s is not None:
            return self.client._renew_interval_s
        remaining = (expires_at - self.client._wall_clock()).total_seconds()
        return max(_MIN_RENEW_INTERVAL_S, remaining / 3)

    def result(
        self, outcome: CallOutcome, *, request_sent: RequestSent | None = None, reason: str | None = None
    ) -> CallResult:
        return CallResult(
            outcome=outcome,
            reservation_id=self.grant.reservation_id,
            provider_request_id=self.provider_request_id,
            content="".join(self.content),
            input_tokens=self.input_tokens,
            output_tokens=self.reported_output,
            usage_events=self.delivered,
            request_sent=request_sent,
            reason=reason,
        )
