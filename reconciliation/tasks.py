"""Celery beat tasks. Each is thin (one service call), idempotent and safe to run twice at once:
the database decides through state guards, fences and SKIP LOCKED, not a Redis lock."""

from __future__ import annotations

import logging
from typing import Any

from celery import shared_task
from django.utils import timezone

from reconciliation import operations

logger = logging.getLogger(__name__)

TASK_OPTIONS: dict[str, Any] = {
    "acks_late": True,
    "reject_on_worker_lost": True,
    "time_limit": 120,
    "soft_time_limit": 100,
}


@shared_task(name="reconciliation.reclaim_expired_leases", **TASK_OPTIONS)
def reclaim_expired_leases() -> dict[str, int]:
    return operations.reclaim(now=timezone.now())


@shared_task(name="reconciliation.lookup_unknown_outcomes", **TASK_OPTIONS)
def lookup_unknown_outcomes() -> dict[str, int]:
    return operations.lookup(now=timezone.now())


@shared_task(name="reconciliation.admit_queued", **TASK_OPTIONS)
def admit_queued() -> dict[str, int]:
    return operations.admit_queue(now=timezone.now())


@shared_task(name="reconciliation.audit_ledger", **TASK_OPTIONS)
def audit_ledger() -> dict[str, int]:
    return operations.audit(now=timezone.now())


@shared_task(name="reconciliation.import_provider_billing", **TASK_OPTIONS)
def import_provider_billing() -> dict[str, int]:
    return operations.import_provider_billing(now=timezone.now())


@shared_task(name="reconciliation.expire_temporary_increases", **TASK_OPTIONS)
def expire_temporary_increases() -> dict[str, int]:
    return operations.expire_increases(now=timezone.now())


@shared_task(name="reconciliation.roll_periods", **TASK_OPTIONS)
def roll_periods() -> dict[str, int]:
    return operations.roll_periods(now=timezone.now())
