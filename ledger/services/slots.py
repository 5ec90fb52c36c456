"""Concurrency slots of calls that cannot still be running (SPEC §5).

Concurrency counts calls that may still be running. A reservation whose outcome is unknown (``RECONCILING``,
or ``PARTIALLY_SETTLED`` after a failure) keeps its tokens held until evidence arrives, but once its lease
has expired AND its pool's maximum call duration (``ModelPool.max_call_seconds``) has passed since dispatch,
no provider call of it can still run: its slot is released, with a ``SLOT_FREE`` entry on every held
account saying why. Nothing else moves; the tokens wait for the provider lookup, the billing import or a
person as before.
"""

from __future__ import annotations

import functools
import uuid
from datetime import datetime, timedelta

from django.db import transaction
from django.db.models import DateTimeField, ExpressionWrapper, F

from ledger import locks
from ledger.models import EntryKind, Reservation, State
from ledger.services.postings import Postings, held_account_ids
from ledger.services.retries import with_retries

# The states in which a dispatched call's slot may still be held while its outcome is unknown.
_UNSETTLED = (State.RECONCILING, State.PARTIALLY_SETTLED)


def _ended(now: datetime) -> list[uuid.UUID]:
    """Reservations holding a slot whose call cannot be running at ``now`` (the database clock's)."""
    ends = ExpressionWrapper(
        F("dispatched_at") + F("model_pool__max_call_seconds") * timedelta(seconds=1),
        output_field=DateTimeField(),
    )
    return list(
        Reservation.objects.filter(
            state__in=_UNSETTLED,
            concurrency_held=True,
            lease_expires_at__lt=now,
            dispatched_at__isnull=False,
        )
        .alias(ends=ends)
        .filter(ends__lt=now)
        .values_list("pk", flat=True)
    )


def free_ended_calls(*, now: datetime) -> int:
    """Release the concurrency slot of every call that cannot still be running; return how many.

    Each is re-checked under its row lock against the database clock (a renewal or a settlement in between
    wins), in its own transaction.
    """
    return sum(with_retries(functools.partial(_free_one, reservation_id)) for reservation_id in _ended(now))


def _free_one(reservation_id: uuid.UUID) -> int:
    with transaction.atomic(durable=True):
        reservation = locks.lock_reservation(reservation_id)
        if reservation is None or not reservation.concurrency_held or reservation.state not in _UNSETTLED:
            return 0
        db_now: datetime = reservation.db_now  # type: ignore[attr-defined]
        max_call = timedelta(seconds=reservation.model_pool.max_call_seconds)
        if (
            reservation.lease_expires_at is None
            or reservation.lease_expires_at >= db_now
            or reservation.dispatched_at is None
            or reservation.dispatched_at + max_call >= db_now
        ):
            return 0
        posts = Postings(reservation, held_account_ids(reservation))
        free_slot(
            posts,
            f"the call cannot be running: lease expired and {max_call.total_seconds():g} s (the pool's "
            "maximum call duration) passed since dispatch; tokens stay held until evidence",
        )
        posts.flush()
        return 1


def free_slot(posts: Postings, reason: str) -> None:
    """Free the concurrency slot of the locked reservation of ``posts`` on every held account (a
    ``SLOT_FREE`` entry each, written by the caller's ``flush``); its tokens are untouched."""
    reservation = posts.reservation
    if not reservation.concurrency_held:
        return
    reservation.concurrency_held = False
    posts.move(EntryKind.SLOT_FREE, in_flight=-1, reason=reason)
