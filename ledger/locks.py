"""Every row lock of the ledger, in one place and one canonical order.

Order: a reservation row first (at most one per transaction), then capacity accounts by ascending primary key.
The two statements that move balances (``ledger/statements.py``: a hold, a use case's moves) lock their
accounts inside themselves in the same ascending order, after the reservation's row (a new one's INSERT, the
row this module locked, or a lifecycle write's UPDATE of the row version it read), so two transactions never
wait on each other in opposite directions and cannot deadlock.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from budgeting.catalog.models import CURRENT_VERSION_SQL, ModelPool
from budgeting.db.rows import fetch_rows
from ledger.models import CapacityAccount, Hold, Reservation


def lock_reservation(
    reservation_id: uuid.UUID, tenant_ids: Iterable[int] | None = None
) -> Reservation | None:
    """Lock and return a fresh copy of one reservation, or None if it does not exist for these tenants.

    FOR UPDATE because a write that reads state, fence and amounts and then writes them must not act on a
    copy another transaction changes meanwhile: two usage events could both read ``remaining`` and capture it
    twice. (A lifecycle call's one write may instead read without the lock, ``read_reservation``, and write
    only to the row version it read: ``lifecycle._written``.) The stored documents (the first
    answer, a queued request) are deferred: no lifecycle write reads them, and unpacking one (and writing it
    back) was most of a lifecycle call's time for a large admission.
    """
    # One statement, its text built once: the held accounts (every write that follows moves their
    # balances), the database clock, the catalog version (an unchecked caller's check:
    # ``Caller.checked_version``) and the pool's provider adapter and endpoint (what a dispatch records)
    # come with the row. Its other columns but the stored documents are the model's fields.
    params: list[Any] = [reservation_id] if tenant_ids is None else [reservation_id, list(tenant_ids)]
    found = fetch_rows(Reservation, _lock_sql(tenant_ids is not None, locked=True), params)
    return found[0] if found else None


def read_reservation(reservation_id: uuid.UUID, tenant_ids: Iterable[int]) -> Reservation | None:
    """``lock_reservation``'s read WITHOUT the lock, with the row's version (``row_version``, its xmin): for a
    write that is conditional on that version (``statements.move_balances``' ``unchanged_since``)."""
    found = fetch_rows(Reservation, _lock_sql(True, locked=False), [reservation_id, list(tenant_ids)])
    return found[0] if found else None


def read_reservations(
    reservation_ids: Sequence[uuid.UUID], tenant_ids: Iterable[int]
) -> dict[uuid.UUID, Reservation]:
    """``read_reservation`` of several reservations in one statement, by id (those found)."""
    found = fetch_rows(
        Reservation, _lock_sql(True, locked=False, many=True), [list(reservation_ids), list(tenant_ids)]
    )
    return {reservation.pk: reservation for reservation in found}


# Read by no lifecycle write, and large: left deferred (an access reads them on demand).
_DEFERRED = ("request_body", "response_body")


@functools.cache
def _lock_sql(scoped: bool, *, locked: bool, many: bool = False) -> str:
    columns = ", ".join(
        f'r."{f.column}"' for f in Reservation._meta.concrete_fields if f.attname not in _DEFERRED
    )
    tenants = " AND r.tenant_id = ANY(%s::bigint[])" if scoped else ""
    return (
        f"SELECT {columns},"
        f" ARRAY(SELECT h.account_id FROM {Hold._meta.db_table} h WHERE h.reservation_id = r.id"
        "  ORDER BY h.account_id) AS held_account_ids,"
        " clock_timestamp() AS db_now, p.adapter AS pool_adapter, p.provider_base_url AS pool_endpoint,"
        f" r.xmin::text AS row_version, ({CURRENT_VERSION_SQL}) AS catalog_version"
        f" FROM {Reservation._meta.db_table} r JOIN {ModelPool._meta.db_table} p ON p.id = r.model_pool_id"
        f" WHERE r.id = {'ANY(%s::uuid[])' if many else '%s'}{tenants}{' FOR UPDATE OF r' if locked else ''}"
    )


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


def lock_reconciling(expired_before: object, limit: int) -> list[Reservation]:
    """Lock RECONCILING reservations whose claim lease expired, oldest first, skipping locked rows."""
    return list(
        Reservation.objects.select_for_update(skip_locked=True, of=("self",))
        .filter(state="RECONCILING", lease_expires_at__lt=expired_before)
        .order_by("lease_expires_at")[:limit]
    )
