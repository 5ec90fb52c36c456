"""What the admission protocol exchanges: its ids, the grant an admission answers, how one call ended."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final, Literal, TypeGuard

from tokenbudget_gateway.errors import ProtocolViolation, RequestSent
from tokenbudget_gateway.transport import ApiResponse

CallOutcome = Literal["completed", "usage_unknown", "failed", "cancelled", "unsettled"]

ADMISSIONS_PATH: Final = "/api/v1/admissions"
_PROVIDER_IDS: Final = uuid.UUID("5b0f7c1e-2d6a-4e58-9a43-0c1e7f5d2b90")


def provider_request_id_for(reservation_id: str) -> str:
    """The provider request id of a reservation: stable, so retries and lookups all use the same one."""
    return f"tbr-{reservation_id}"


def provider_request_id_of_key(idempotency_key: str) -> str:
    """The provider request id an admission that records its dispatch names: derived from its
    ``Idempotency-Key`` (a name UUID), so a repeated admission names the same id and the first answer
    stands."""
    return f"tbr-{uuid.uuid5(_PROVIDER_IDS, idempotency_key)}"


def usage_event_id(provider_request_id: str, seq: int) -> str:
    """The id of the ``seq``-th (1-based) usage event of a provider request."""
    if seq < 1:
        raise ValueError("usage event sequence numbers start at 1")
    return f"{provider_request_id}:{seq}"


@dataclass(frozen=True)
class Grant:
    """What a 201 (or replayed 200) admission grants."""

    reservation_id: str
    fence: int
    admitted_digest: str
    payload: Any
    max_output: int
    lease_expires_at: datetime
    replayed: bool
    rung: str = "FULL"
    input_tokens: int | None = None
    dispatched_as: str | None = None
    """The provider request id the admission recorded the dispatch under (its answer is ``DISPATCHED``), or
    ``None``: the gateway records the dispatch itself before the provider call."""

    @classmethod
    def from_response(cls, response: ApiResponse) -> Grant:
        """Read a grant from an admission answer. Raises ``ProtocolViolation`` if fields are missing."""
        body = response.body
        if not isinstance(body, dict):
            raise ProtocolViolation("admission answer is not a JSON object")
        lease, tokens = body.get("lease"), body.get("tokens")
        if not isinstance(lease, dict) or not isinstance(tokens, dict):
            raise ProtocolViolation("admission answer lacks lease or tokens")
        try:
            reservation_id = body["reservationId"]
            fence = lease["fence"]
            admitted_digest = body["admittedDigest"]
            max_output = tokens["maxOutput"]
            expires_at = parse_time(lease["expiresAt"])
            payload = body["payload"]
        except (KeyError, ValueError) as exc:
            raise ProtocolViolation(f"admission answer lacks a field: {exc}") from exc
        rung, input_tokens = body.get("rung"), tokens.get("input")
        dispatched_as = body.get("providerRequestId") if body.get("state") == "DISPATCHED" else None
        if not isinstance(reservation_id, str | int) or isinstance(reservation_id, bool):
            raise ProtocolViolation("reservationId is not a string")
        if not is_int(fence) or not isinstance(admitted_digest, str) or not is_int(max_output):
            raise ProtocolViolation("lease.fence, admittedDigest or tokens.maxOutput has the wrong type")
        return cls(
            reservation_id=str(reservation_id),
            fence=fence,
            admitted_digest=admitted_digest,
            payload=payload,
            max_output=max_output,
            lease_expires_at=expires_at,
            replayed=response.headers.get("idempotent-replayed", "").lower() == "true",
            rung=rung if isinstance(rung, str) and rung else "FULL",
            input_tokens=input_tokens if is_int(input_tokens) else None,
            dispatched_as=dispatched_as if isinstance(dispatched_as, str) and dispatched_as else None,
        )


def is_int(value: object) -> TypeGuard[int]:
    """Whether a JSON value is an integer."""
    # bool is an int subclass; True must not pass as one token or fence 1.
    return isinstance(value, int) and not isinstance(value, bool)


def parse_time(value: Any) -> datetime:
    """An ISO-8601 timestamp with an offset. Raises ``ValueError`` otherwise."""
    if not isinstance(value, str):
        raise ValueError("timestamp is not a string")
    moment = datetime.fromisoformat(value)
    if moment.tzinfo is None:
        raise ValueError(f"timestamp {value!r} has no offset")
    return moment


@dataclass(frozen=True)
class CallResult:
    """How one call ended.

    ``completed``: the final usage was posted. ``usage_unknown``: the answer arrived without final usage;
    reported through ``/fail`` so the reconciler settles it. ``failed``: the provider call failed;
    ``/fail`` was posted. ``cancelled``: ``/cancel`` was posted. ``unsettled``: the terminal call to our
    API could not be delivered; the lease will expire and the reclaimer reconciles.
    ``output_tokens`` is the sum of the deltas posted (or queued, for ``unsettled``).
    """

    outcome: CallOutcome
    reservation_id: str
    provider_request_id: str
    content: str = ""
    input_tokens: int | None = None
    output_tokens: int = 0
    usage_events: int = 0
    request_sent: RequestSent | None = None
    reason: str | None = None
