"""Every row lock of the ledger, in one place and one canonical order.

Order: a reservation row first (at most one per transaction), then capacity accounts by ascending primary key.
The two statements that move balances (``ledger/statements.py``: a hold, a use case's moves) lock their
accounts inside themselves in the same ascending order, after the reservation's row (a new one's INSERT, or
the row this module locked), so two transactions never wait on each other in opposite directions and cannot
deadlock.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from django.contrib.postgres.expressions import ArraySubquery
from django.db.models import DateTimeField, Func, OuterRef

from ledger.models import CapacityAccount, Hold, Reservation


def lock_reservation(
    reservation_id: uuid.UUID, tenant_ids: Iterable[int] | None = None
) -> Reservation | None:
    """Lock and return a fresh copy of one reservation, or None if it does not exist for these tenants.

    FOR UPDATE because every lifecycle write reads state, fence and amounts and then writes them: without the
    lock two usage events could both read ``remaining`` and capture it twice. The stored documents (the first
    answer, a queued request) are deferred: no lifecycle write reads them, and unpacking one (and writing it
    back) was most of a lifecycle call's time for a large admission.
    """
    # The held accounts come with the row (one statement): every write that follows moves their balances.
    held = Hold.objects.filter(reservation=OuterRef("pk")).order_by("account_id").values("account_id")
    queryset = (
        Reservation.objects.select_for_update(of=("self",))
        .defer("request_body", "response_body")
        .filter(pk=reservation_id)
        .annotate(
            held_account_ids=ArraySubquery(held),
            db_now=Func(function="clock_timestamp", output_field=DateTimeField()),
        )
    )
    if tenant_ids is not None:
        queryset = queryset.filter(tenant_id__in=list(tenant_ids))
    return queryset.first()


def lock_account(account_id: int) -> CapacityAccount:
    """Lock one account row (roll-over and corrections read balances before writing entries)."""
    return CapacityAccount.objects.select_for_update().get(pk=account_id)


def lock_expired_leases(
    states: Sequence[str], db_now: object, limit: int, exclude: Sequence[uuid.UUID] = ()
) -> list[Reservation]:
    """Lock reservations whose lease expired, skipping rows another reclaimer (or a gateway write) holds."""
    return list(
        Reservation.objects.select_for_update(skip_locked=True, of=("self",))
        .filter(state__in=states, lease_expires_at__lt=db_now)
        .exclude(pk__in=list(exclude))
        .order_by("lease_expires_at")[:limit]
    )


def lock_account_periods(account_ids: Sequence[int]) -> dict[int, Any]:
    """Lock accounts in ascending order and return their current period starts (a write follows)."""
    return dict(
        CapacityAccount.objects.select_for_update()
        .filter(pk__in=list(account_ids))
        .order_by("pk")
        .values_list("pk", "period_start")
    )


def lock_reconciling(expired_before: object, limit: int) -> list[Reservation]:
    """Lock RECONCILING reservations whose claim lease expired, oldest first, skipping locked rows."""
    return list(
        Reservation.objects.select_for_update(skip_locked=True, of=("self",))
        .filter(state="RECONCILING", lease_expires_at__lt=expired_before)
        .order_by("lease_expires_at")[:limit]
    )
