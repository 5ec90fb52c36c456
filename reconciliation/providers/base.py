"""The lookup protocol of provider adapters, what an adapter can prove, and when "not found" is proof.

An answer that is not positive, well-formed evidence is ``UNKNOWN``: a network error, a timeout, a 5xx or a
malformed body never releases anything. "Not found" (``NOT_FOUND``) is its own status and proves nothing by
itself; ``judge`` turns it into proof of non-processing only when the adapter can vouch for it (SPEC §5): the
lookup went to the endpoint recorded at dispatch, within the provider's retention window, for an id the
provider would know, and the gateway did not report the request as sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Literal, Protocol, TypeGuard

BillingGranularity = Literal["request", "bucket"]


class LookupStatus(StrEnum):
    """What a provider lookup established about one provider request."""

    COMPLETED = "COMPLETED"
    """The provider processed it; the billed usage is known."""
    NOT_PROCESSED = "NOT_PROCESSED"
    """The provider's answer documents that it did not process (nor bill) the request."""
    NOT_FOUND = "NOT_FOUND"
    """The provider does not know the id: proof only when ``judge`` says the adapter can vouch for it."""
    RUNNING = "RUNNING"
    UNKNOWN = "UNKNOWN"


@dataclass(frozen=True)
class LookupResult:
    """The outcome of looking up one provider request; usage only for ``COMPLETED``.

    Raises ``ValueError`` on an inconsistent combination, so a buggy adapter cannot fabricate evidence.
    """

    status: LookupStatus
    input_tokens: int = 0
    output_tokens: int = 0
    detail: str = ""

    def __post_init__(self) -> None:
        if self.input_tokens < 0 or self.output_tokens < 0:
            raise ValueError("token counts cannot be negative")
        if self.status is not LookupStatus.COMPLETED and (self.input_tokens or self.output_tokens):
            raise ValueError(f"{self.status} carries no usage")

    @classmethod
    def unknown(cls, detail: str) -> LookupResult:
        """An answer that proves nothing; the reservation stays held."""
        return cls(status=LookupStatus.UNKNOWN, detail=detail)


@dataclass(frozen=True)
class Capabilities:
    """What an adapter can prove. Declared by each adapter and checked by ``judge``, never inferred."""

    lookup: bool
    """It can look up a call's outcome by the provider request id recorded at dispatch."""
    vouches_not_found: bool
    """Its "not found" means the provider never processed the request: the provider records every id it
    accepts before processing, its lookup is strongly consistent, and it forgets nothing within
    ``retention``."""
    retention: timedelta | None
    """How long the provider keeps what a lookup reads; None: as long as the endpoint runs."""
    billing: BillingGranularity
    """``request``: billing records name calls and settle them; ``bucket``: totals, compared only."""


class ProviderAdapter(Protocol):
    """Looks up one provider request by the id the gateway recorded at dispatch."""

    name: str
    """The registry name a pool uses, recorded on each reservation at dispatch."""
    endpoint: str
    """Where lookups go (base URL without a trailing slash), recorded on each reservation at dispatch."""
    capabilities: Capabilities

    def knows(self, provider_request_id: str) -> bool:
        """Whether the provider would know this id (one it issued, or accepts from the gateway)."""
        ...

    def lookup(self, provider_request_id: str) -> LookupResult:
        """Return what the provider knows; never raises for provider-side trouble (that is ``UNKNOWN``)."""
        ...


def normalise_endpoint(base_url: str) -> str:
    """The form endpoints are recorded and compared in."""
    return base_url.strip().rstrip("/")


@dataclass(frozen=True)
class DispatchRecord:
    """What the ledger recorded about a dispatched call that a lookup is judged against."""

    provider_request_id: str
    adapter: str
    endpoint: str
    dispatched_at: datetime | None
    request_sent: str
    """What the gateway reported in ``/fail``: ``yes``, ``no``, ``unknown``, or empty (never failed)."""


class Verdict(StrEnum):
    COMPLETED = "COMPLETED"
    """Settle at the billed usage."""
    NOT_PROCESSED = "NOT_PROCESSED"
    """Release in full, input refunded."""
    WAIT = "WAIT"
    """Stays RECONCILING: a later lookup or the per-request billing import may settle it."""
    PERSON = "PERSON"
    """Stays RECONCILING and needs a person: nothing automatic will ever settle it."""


@dataclass(frozen=True)
class Judgement:
    verdict: Verdict
    reason: str


def _unproven(adapter: ProviderAdapter, why: str) -> Judgement:
    """Nothing proves what happened to the call. A per-request billing import may still name it; with bucket
    billing nothing automatic ever will, so a person compares it with the usage report."""
    if adapter.capabilities.billing == "request":
        return Judgement(Verdict.WAIT, f"{why}: waiting for the billing export")
    return Judgement(
        Verdict.PERSON, f"{why}, and {adapter.name} bills by the bucket: compare with its usage report"
    )


def before_lookup(adapter: ProviderAdapter, record: DispatchRecord) -> Judgement | None:
    """Why no lookup through ``adapter`` can settle this call (then none is made), or None to look up."""
    if not adapter.capabilities.lookup:
        return _unproven(adapter, f"{adapter.name} cannot look calls up")
    if not record.endpoint:
        return Judgement(Verdict.WAIT, "no provider endpoint was recorded at dispatch")
    if (record.adapter, record.endpoint) != (adapter.name, adapter.endpoint):
        return Judgement(
            Verdict.PERSON,
            f"dispatched through {record.adapter} at {record.endpoint}; the pool now names {adapter.name} "
            f"at {adapter.endpoint}, whose answers say nothing about this call",
        )
    return None


def judge(
    adapter: ProviderAdapter, record: DispatchRecord, result: LookupResult, *, now: datetime
) -> Judgement:
    """Decide what a lookup answer proves about a call (``before_lookup`` passed for this adapter)."""
    if result.status is LookupStatus.COMPLETED:
        return Judgement(Verdict.COMPLETED, f"{adapter.name}: completed {result.detail}".strip())
    if result.status is LookupStatus.NOT_PROCESSED:
        if not adapter.knows(record.provider_request_id):
            return Judgement(Verdict.WAIT, f"{adapter.name} answered for an id it would not know")
        return Judgement(Verdict.NOT_PROCESSED, f"{adapter.name}: {result.detail or 'not processed'}")
    if result.status is not LookupStatus.NOT_FOUND:
        return Judgement(Verdict.WAIT, f"{adapter.name}: {result.status.lower()} {result.detail}".strip())
    capabilities = adapter.capabilities
    if not capabilities.vouches_not_found:
        return _unproven(adapter, f"{adapter.name} cannot vouch for 'not found'")
    if not adapter.knows(record.provider_request_id):
        return _unproven(adapter, f"{adapter.name} would not know id {record.provider_request_id!r}")
    if capabilities.retention is not None and (
        record.dispatched_at is None or now - record.dispatched_at > capabilities.retention
    ):
        return _unproven(adapter, f"not found, but dispatched beyond {adapter.name}'s retention window")
    if record.request_sent == "yes":
        return Judgement(
            Verdict.PERSON, f"the gateway reported the request sent; {adapter.name} does not know it"
        )
    return Judgement(Verdict.NOT_PROCESSED, f"{adapter.name}: not found (vouched)")


def is_count(value: object) -> TypeGuard[int]:
    """A non-negative int; bool is an int subclass, and True must not pass as one token."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
