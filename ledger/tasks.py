"""The ledger's beat tasks: the audit, the expiry of temporary increases, period roll-overs. Each is one
service call, idempotent and safe to run twice at once; the names keep their first prefix
(``reconciliation.``) so that a running beat's schedule and queued messages still find them. Options: the
CELERY_TASK_* settings."""

from __future__ import annotations

import logging

from celery import shared_task
from django.utils import timezone

from ledger import selectors
from ledger.services import accounts, limits

logger = logging.getLogger(__name__)


@shared_task(name="reconciliation.audit_ledger")
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


@shared_task(name="reconciliation.expire_temporary_increases")
def expire_temporary_increases() -> dict[str, int]:
    return {"ended": limits.expire_temporary_increases(now=timezone.now())}


@shared_task(name="reconciliation.roll_periods")
def roll_periods() -> dict[str, int]:
    return {"rolled": accounts.roll_over_due(now=timezone.now())}
