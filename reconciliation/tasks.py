"""Celery beat tasks. Each is thin (one service call, its figures returned for the log), idempotent
and safe to run twice at once: the database decides (state guards, fences, SKIP LOCKED), not a lock."""

from __future__ import annotations

import logging
from typing import Any

from celery import shared_task
from django.utils import timezone

from budgeting.admission import queue
from ledger import selectors
from ledger.services import accounts, limits, slots
from reconciliation import billing, reclaim

logger = logging.getLogger(__name__)

TASK_OPTIONS: dict[str, Any] = {
    "acks_late": True,
    "reject_on_worker_lost": True,
    "time_limit": 120,
    "soft_time_limit": 100,
}


@shared_task(name="reconciliation.reclaim_expired_leases", **TASK_OPTIONS)
def reclaim_expired_leases() -> dict[str, int]:
    now = timezone.now()
    report = reclaim.reclaim_expired_leases(now=now)
    return {
        "released": report.released,
        "frozen": report.frozen,
        "settled": report.settled,
        "refunded": report.refunded,
        "stillUnknown": report.still_unknown,
        # Unknown outcomes keep their tokens; a call past its pool's maximum duration gives its slot back.
        "slotsFreed": slots.free_ended_calls(now=now),
    }


@shared_task(name="reconciliation.lookup_unknown_outcomes", **TASK_OPTIONS)
def lookup_unknown_outcomes() -> dict[str, int]:
    report = reclaim.lookup_unknown_outcomes(now=timezone.now())
    return {"settled": report.settled, "refunded": report.refunded, "stillUnknown": report.still_unknown}


@shared_task(name="reconciliation.admit_queued", **TASK_OPTIONS)
def admit_queued() -> dict[str, int]:
    return queue.admit_queue(now=timezone.now())


@shared_task(name="reconciliation.audit_ledger", **TASK_OPTIONS)
def audit_ledger() -> dict[str, int]:
    report = selectors.audit(now=timezone.now())
    for line in report.violations + report.leaks:
        logger.error("ledger audit: %s", line)
    return {
        "accounts": report.accounts_checked,
        "reservations": report.reservations_checked,
        "violations": len(report.violations),
        "leaks": len(report.leaks),
    }


@shared_task(name="reconciliation.import_provider_billing", **TASK_OPTIONS)
def import_provider_billing() -> dict[str, int]:
    return billing.fetch_and_import(now=timezone.now())


@shared_task(name="reconciliation.expire_temporary_increases", **TASK_OPTIONS)
def expire_temporary_increases() -> dict[str, int]:
    return {"ended": limits.expire_temporary_increases(now=timezone.now())}


@shared_task(name="reconciliation.roll_periods", **TASK_OPTIONS)
def roll_periods() -> dict[str, int]:
    return {"rolled": accounts.roll_over_due(now=timezone.now())}
