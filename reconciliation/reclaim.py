"""Reclaiming expired leases and resolving unknown outcomes from provider lookups.

The database decides who does what (fences and SKIP LOCKED), so two workers or two beats running the same
task at once never double-apply anything. Provider lookups are slow I/O and happen between transactions.
What a lookup proves is decided by ``providers.base``: "not found" releases a call only when the pool's
adapter can vouch for it; a call nothing automatic can ever settle (evidence that contradicts our record, a
provider that moved, or one that bills by the bucket and cannot vouch) is flagged for a person and no longer
looked up.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

from budgeting.catalog.models import ModelPool
from ledger.models import Reservation
from ledger.services import settlement
from reconciliation.providers import registry
from reconciliation.providers.base import (
    DispatchRecord,
    Judgement,
    ProviderAdapter,
    Verdict,
    before_lookup,
    judge,
    normalise_endpoint,
)

logger = logging.getLogger(__name__)

LookupFor = Callable[[int], ProviderAdapter | None]


def pool_provider(pool: ModelPool) -> registry.PoolProvider:
    """A pool's provider settings, its keys read from the environment variables it names."""
    return registry.PoolProvider(
        adapter=pool.adapter,
        base_url=pool.provider_base_url,
        api_key=os.environ.get(pool.api_key_env) if pool.api_key_env else None,
        admin_key=os.environ.get(pool.admin_key_env) if pool.admin_key_env else None,
    )


def lookup_for_pool(pool_id: int) -> ProviderAdapter | None:
    """The provider adapter configured for a model pool, or None when the pool names no endpoint."""
    pool = ModelPool.objects.filter(pk=pool_id).first()
    return registry.build(pool_provider(pool)) if pool is not None else None


@dataclass
class ReclaimReport:
    released: int = 0
    frozen: int = 0
    settled: int = 0
    refunded: int = 0
    still_unknown: int = 0
    needs_person: int = 0
    details: list[str] = field(default_factory=list)


def _judge_claim(
    claim: settlement.Claim, adapter: ProviderAdapter, now: datetime
) -> tuple[Judgement, int, int]:
    """What a lookup through ``adapter`` proves about the claimed call: (judgement, billed input, output)."""
    record = DispatchRecord(
        provider_request_id=claim.provider_request_id,
        adapter=claim.provider_adapter,
        endpoint=normalise_endpoint(claim.provider_endpoint),
        dispatched_at=claim.dispatched_at,
        request_sent=claim.request_sent,
    )
    early = before_lookup(adapter, record)
    if early is not None:
        return early, 0, 0
    shared = (
        Reservation.objects.filter(
            provider_request_id=claim.provider_request_id, provider_endpoint=claim.provider_endpoint
        )
        .exclude(pk=claim.reservation_id)
        .exists()
    )
    if shared:
        # Ids are unique per tenant only: the provider's answer could be about another tenant's call.
        return Judgement(Verdict.PERSON, "another call was dispatched with this provider request id"), 0, 0
    result = adapter.lookup(claim.provider_request_id)
    return judge(adapter, record, result, now=now), result.input_tokens, result.output_tokens


def _resolve(
    claims: list[settlement.Claim], lookup_for: LookupFor, now: datetime, report: ReclaimReport
) -> None:
    for claim in claims:
        adapter = lookup_for(claim.pool_id) if claim.provider_request_id else None
        if adapter is None:
            report.still_unknown += 1
            continue
        judgement, billed_input, billed_output = _judge_claim(claim, adapter, now)
        if judgement.verdict == Verdict.WAIT:
            report.still_unknown += 1
            continue
        if judgement.verdict == Verdict.PERSON:
            # Still unknown, and from now on a person's: counted in both.
            report.still_unknown += 1
            if settlement.flag_for_person(
                reservation_id=claim.reservation_id, fence=claim.fence, reason=judgement.reason, now=now
            ):
                report.needs_person += 1
                logger.warning("reservation %s needs a person: %s", claim.reservation_id, judgement.reason)
            continue
        source = f"lookup at {adapter.name}"
        if judgement.verdict == Verdict.COMPLETED:
            evidence = settlement.Evidence(
                settlement.EvidenceKind.COMPLETED, billed_input, billed_output, source=source
            )
        else:
            evidence = settlement.Evidence(settlement.EvidenceKind.NOT_PROCESSED, source=source)
        settled = settlement.settle_from_evidence(
            reservation_id=claim.reservation_id, fence=claim.fence, evidence=evidence, now=now
        )
        if settled is None:
            report.details.append(
                f"{claim.reservation_id}: not settled (fence moved, settled, or contradicted)"
            )
        elif evidence.kind == settlement.EvidenceKind.NOT_PROCESSED:
            report.refunded += 1
        else:
            report.settled += 1


def reclaim_expired_leases(
    *, now: datetime, lookup_for: LookupFor = lookup_for_pool, limit: int = 100
) -> ReclaimReport:
    """Take over expired leases and resolve what the provider can prove; everything else stays RECONCILING."""
    report = ReclaimReport()
    released, claims = settlement.claim_expired_leases(now=now, limit=limit)
    report.released = len(released)
    report.frozen = len(claims)
    _resolve(claims, lookup_for, now, report)
    return report


def lookup_unknown_outcomes(
    *, now: datetime, lookup_for: LookupFor = lookup_for_pool, limit: int = 100
) -> ReclaimReport:
    """Retry provider lookups for RECONCILING reservations whose previous claim lease ran out."""
    report = ReclaimReport()
    _resolve(settlement.claim_reconciling(limit=limit), lookup_for, now, report)
    return report
