"""Reconciliation's beat tasks: reclaiming expired leases, looking up unknown outcomes, importing provider
billing. Each is thin (one service call, its figures returned for the log), idempotent and safe to run twice
at once: the database decides (state guards, fences, SKIP LOCKED), not a lock. Their options (acks late, time
limits) are the CELERY_TASK_* settings; the other rooms' beat tasks are in ``ledger/tasks.py`` and
``budgeting/admission/tasks.py``."""

from __future__ import annotations

from celery import shared_task
from django.utils import timezone

from ledger.services import slots
from reconciliation import billing, reclaim


@shared_task(name="reconciliation.reclaim_expired_leases")
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


@shared_task(name="reconciliation.lookup_unknown_outcomes")
def lookup_unknown_outcomes() -> dict[str, int]:
    report = reclaim.lookup_unknown_outcomes(now=timezone.now())
    return {"settled": report.settled, "refunded": report.refunded, "stillUnknown": report.still_unknown}


@shared_task(name="reconciliation.import_provider_billing")
def import_provider_billing() -> dict[str, int]:
    return billing.fetch_and_import(now=timezone.now())
