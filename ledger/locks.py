"""Every row lock of the ledger, in one place and one canonical order.

Order: a reservation row first (at most one per transaction), then capacity accounts by ascending primary key.
Admission inserts its (new, uncontended) reservation row and then updates accounts in the same
ascending order, so two transactions never wait on each other in opposite directions and cannot deadlock.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from django.contrib.postgres.expressions import ArraySubquery
from django.db import connection
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


def db_now() -> object:
    """The database clock: leases and fences never trust an application server's clock."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT clock_timestamp()")
        return cursor.fetchone()[0]


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


def reserve_on_accounts(
    account_ids: Sequence[int],
    *,
    input_tokens: int,
    output_tokens: int,
    concurrency: int,
    spend: int = 0,
    currency: str = "",
) -> int | None:
    """Hold capacity on every account in one statement; returns None, or the first account that is short.

    The CTE locks the rows in ascending id order (FOR UPDATE as the sorted rows are emitted), which is the
    canonical order. The UPDATE's WHERE clause is then evaluated on the latest row version (Read Committed
    re-checks a row changed by a concurrent writer), so two transactions can never both pass the check on
    stale balances. If any account is short, the caller rolls the whole transaction back. Money (``spend``
    micro-units of ``currency``) is held on the accounts kept in that currency; an account with a spend limit
    refuses a hold in another currency (or none).
    """
    ids = sorted(account_ids)
    with connection.cursor() as cursor:
        cursor.execute(
            """
            WITH ordered AS (
                SELECT id FROM ledger_capacityaccount WHERE id = ANY(%(ids)s) ORDER BY id FOR UPDATE
            )
            UPDATE ledger_capacityaccount AS a
               SET input_reserved = a.input_reserved + %(i)s,
                   output_reserved = a.output_reserved + %(o)s,
                   in_flight = a.in_flight + %(c)s,
                   spend_reserved = a.spend_reserved + %(s)s * (a.currency = %(cur)s)::int
              FROM ordered
             WHERE a.id = ordered.id
               AND (a.input_limit IS NULL OR %(i)s = 0
                    OR a.input_reserved + a.input_consumed + %(i)s <= a.input_limit)
               AND (a.output_limit IS NULL OR %(o)s = 0
                    OR a.output_reserved + a.output_consumed + %(o)s <= a.output_limit)
               AND (a.concurrency_limit IS NULL OR %(c)s = 0 OR a.in_flight + %(c)s <= a.concurrency_limit)
               AND (a.spend_limit IS NULL OR (a.currency = %(cur)s
                    AND a.spend_reserved + a.spend_consumed + %(s)s <= a.spend_limit))
            RETURNING a.id
            """,
            {
                "ids": ids,
                "i": input_tokens,
                "o": output_tokens,
                "c": concurrency,
                "s": spend,
                "cur": currency,
            },
        )
        held = {row[0] for row in cursor.fetchall()}
    return next((account_id for account_id in ids if account_id not in held), None)
