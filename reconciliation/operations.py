"""What the beat tasks and management commands run: one call each, returning figures to log."""

from __future__ import annotations

import logging
import urllib.request
from datetime import datetime

from budgeting import admin_services
from budgeting.admission.orchestrator import queued_body
from budgeting.catalog.models import ModelPool
from ledger import selectors
from ledger import services as ledger
from ledger.models import CapacityAccount, Reservation, State
from ledger.periods import period_start_for
from reconciliation import billing
from reconciliation import reclaim as services

logger = logging.getLogger(__name__)


def reclaim(*, now: datetime) -> dict[str, int]:
    report = services.reclaim_expired_leases(now=now)
    return {
        "released": report.released,
        "frozen": report.frozen,
        "settled": report.settled,
        "refunded": report.refunded,
        "stillUnknown": report.still_unknown,
    }


def lookup(*, now: datetime) -> dict[str, int]:
    report = services.lookup_unknown_outcomes(now=now)
    return {"settled": report.settled, "refunded": report.refunded, "stillUnknown": report.still_unknown}


def admit_queue(*, now: datetime, limit: int = 200) -> dict[str, int]:
    """Admit queued requests in arrival order while capacity allows; reject those past their deadline."""
    admitted = rejected = 0
    ids = list(
        Reservation.objects.filter(state=State.PROPOSED)
        .order_by("created_at")
        .values_list("pk", flat=True)[:limit]
    )
    for reservation_id in ids:
        result = ledger.admit_queued(reservation_id=reservation_id, build_body=queued_body, now=now)
        if result is None:
            continue
        if result.state == State.RESERVED:
            admitted += 1
        else:
            rejected += 1
    return {"admitted": admitted, "rejected": rejected, "stillQueued": len(ids) - admitted - rejected}


def audit(*, now: datetime) -> dict[str, int]:
    report = selectors.audit(now=now)
    for line in report.violations + report.leaks:
        logger.error("ledger audit: %s", line)
    return {
        "accounts": report.accounts_checked,
        "reservations": report.reservations_checked,
        "violations": len(report.violations),
        "leaks": len(report.leaks),
    }


def import_provider_billing(*, now: datetime) -> dict[str, int]:
    """Fetch each pool's provider billing exports (per request and per hour bucket, JSONL) and import them;
    an export seen before is recognised by its digest and changes nothing."""
    totals = {"imports": 0, "unchanged": 0, "failed": 0}
    for pool in ModelPool.objects.exclude(provider_base_url=""):
        for granularity in ("request", "bucket"):
            url = (
                f"{pool.provider_base_url.rstrip('/')}/v1/billing/export?format=jsonl"
                f"&granularity={granularity}&bucket=1h"
            )
            try:
                with urllib.request.urlopen(url, timeout=10) as response:
                    text = response.read().decode("utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                logger.warning("billing export of pool %s unavailable: %s", pool.slug, exc)
                totals["failed"] += 1
                continue
            result = billing.import_export(
                text=text, fmt="jsonl", source=f"pool {pool.slug} ({granularity})", now=now
            )
            totals["imports" if result.created else "unchanged"] += 1
    return totals


def expire_increases(*, now: datetime) -> dict[str, int]:
    return {"ended": admin_services.expire_temporary_increases(now=now)}


def roll_periods(*, now: datetime) -> dict[str, int]:
    rolled = 0
    for account in CapacityAccount.objects.all():
        if account.period_start < period_start_for(account.period, now):
            rolled += int(ledger.roll_over(account_id=account.pk, now=now))
    return {"rolled": rolled}
