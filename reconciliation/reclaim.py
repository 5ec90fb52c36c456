"""Reclaiming expired leases and resolving unknown outcomes from provider lookups.

The database decides who does what (fences and SKIP LOCKED), so two workers or two beats running the same
task at once never double-apply anything. Provider lookups are slow I/O and happen between transactions.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

from budgeting.catalog.models import ModelPool
from ledger.services import settlement
from reconciliation.providers import LookupStatus, ProviderLookup, SimulatorLookup

logger = logging.getLogger(__name__)

LookupFor = Callable[[int], ProviderLookup | None]


def lookup_for_pool(pool_id: int) -> ProviderLookup | None:
    """The provider adapter configured for a model pool, or None when the pool has none."""
    base_url = ModelPool.objects.filter(pk=pool_id).values_list("provider_base_url", flat=True).first()
    return SimulatorLookup(base_url, timeout=5.0) if base_url else None


@dataclass
class ReclaimReport:
    released: int = 0
    frozen: int = 0
    settled: int = 0
    refunded: int = 0
    still_unknown: int = 0
    details: list[str] = field(default_factory=list)


def _resolve(
    claims: list[settlement.Claim], lookup_for: LookupFor, now: datetime, report: ReclaimReport
) -> None:
    for claim in claims:
        adapter = lookup_for(claim.pool_id) if claim.provider_request_id else None
        if adapter is None:
            report.still_unknown += 1
            continue
        result = adapter.lookup(claim.provider_request_id)
        if not result.authoritative:
            report.still_unknown += 1
            continue
        if result.status == LookupStatus.COMPLETED:
            evidence = settlement.Evidence(
                settlement.EvidenceKind.COMPLETED, result.input_tokens, result.output_tokens
            )
        elif result.status == LookupStatus.NOT_PROCESSED:
            evidence = settlement.Evidence(settlement.EvidenceKind.NOT_PROCESSED)
        else:
            report.still_unknown += 1
            continue
        settled = settlement.settle_from_evidence(
            reservation_id=claim.reservation_id, fence=claim.fence, evidence=evidence, now=now
        )
        if settled is None:
            report.details.append(f"{claim.reservation_id}: fence moved on or already settled")
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
