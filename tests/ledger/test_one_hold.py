"""A hold has one shape: a queued admission holds through the same statement as a new one, and a queued
request rejected at its deadline leaves its row consistent with the holds it never had (the audit passes)."""

from __future__ import annotations

from typing import Any

import pytest

from ledger.models import LIMITS, CapacityAccount, Hold, LedgerEntry, Reservation, State
from ledger.selectors import audit
from ledger.services import admission, lifecycle
from tests.ledger.helpers import admit, catalog, now, pool_account, spec, tenant_account

pytestmark = pytest.mark.django_db(transaction=True)


def shape(reservation: Reservation) -> tuple[Any, ...]:
    """What a hold wrote for a reservation: its holds and entries (without ids and times)."""
    reservation.refresh_from_db()
    holds = sorted(Hold.objects.filter(reservation=reservation).values_list("account_id", flat=True))
    entries = sorted(
        LedgerEntry.objects.filter(reservation=reservation).values_list(
            "account_id",
            "kind",
            "input_reserved",
            "output_reserved",
            "input_consumed",
            "output_consumed",
            "in_flight",
            "period_start",
            "reason",
        )
    )
    amounts = (reservation.input_reserved, reservation.output_reserved, reservation.remaining)
    return holds, entries, amounts, reservation.concurrency_held, reservation.state


def test_a_queued_admission_holds_exactly_as_a_new_one():
    cat = catalog()
    tenant = tenant_account(cat, concurrency_limit=1)
    pool_account(cat, output_limit=10_000)
    first = admit(spec(cat)).reservation
    queued = admit(spec(cat, queue=True)).reservation
    assert queued.state == State.PROPOSED
    assert not Hold.objects.filter(reservation=queued).exists()
    lifecycle.cancel(reservation_id=first.pk, tenant_ids=[cat.tenant.pk], fence=1, now=now())
    admitted = admission.admit_queued(
        reservation_id=queued.pk, build_body=lambda r: {"s": r.state}, now=now()
    )
    assert admitted is not None and admitted.state == State.RESERVED
    # A new reservation admitted now (the slot is taken again: give it one more) wrote the same things.
    CapacityAccount.objects.filter(pk=tenant.pk).update(concurrency_limit=2)
    fresh = admit(spec(cat)).reservation
    assert shape(admitted) == shape(fresh)
    assert len(shape(fresh)[1]) == 2
    stored = Reservation.objects.get(pk=queued.pk)
    assert stored.response_body == {"s": State.RESERVED} and stored.request_body is None
    assert stored.lease_expires_at is not None
    assert audit().ok


def test_a_queued_admission_still_short_on_one_account_holds_on_none():
    cat = catalog()
    tenant = tenant_account(cat, output_limit=10_000)
    pool = pool_account(cat, output_limit=60)
    admit(spec(cat, output_tokens=50))
    queued = admit(spec(cat, output_tokens=50, queue=True)).reservation
    assert queued.state == State.PROPOSED
    before = {a.pk: (a.output_reserved, a.in_flight) for a in CapacityAccount.objects.all()}
    entries = LedgerEntry.objects.count()
    assert admission.admit_queued(reservation_id=queued.pk, build_body=lambda r: {}, now=now()) is None
    after = {a.pk: (a.output_reserved, a.in_flight) for a in CapacityAccount.objects.all()}
    assert after == before and set(after) == {tenant.pk, pool.pk}
    assert LedgerEntry.objects.count() == entries
    assert Reservation.objects.get(pk=queued.pk).state == State.PROPOSED
    assert audit().ok


def test_a_deadline_rejection_passes_the_audit():
    cat = catalog()
    tenant_account(cat, concurrency_limit=1)
    admit(spec(cat))
    queued = admit(spec(cat, output_tokens=700, queue=True)).reservation
    Reservation.objects.filter(pk=queued.pk).update(queue_deadline=now().replace(year=2020))
    rejected = admission.admit_queued(reservation_id=queued.pk, build_body=lambda r: {}, now=now())
    assert rejected is not None and rejected.state == State.REJECTED
    stored = Reservation.objects.get(pk=queued.pk)
    assert (stored.remaining, stored.released, stored.captured) == (0, 700, 0)
    assert not Hold.objects.filter(reservation=stored).exists()
    report = audit(reservation_ids=[stored.pk])
    assert report.reservations_checked == 1 and report.ok, report.leaks


def test_the_audit_catches_a_rejection_that_keeps_its_output():
    """Negative control: the row a deadline rejection wrote before the fix is a leak to the audit."""
    cat = catalog()
    tenant_account(cat, concurrency_limit=0)
    queued = admit(spec(cat, queue=True)).reservation
    Reservation.objects.filter(pk=queued.pk).update(state=State.REJECTED)
    assert audit(reservation_ids=[queued.pk]).leaks


def test_every_limit_of_the_table_refuses_in_python_as_the_statement_does():
    cat = catalog()
    account = tenant_account(cat, input_limit=10, output_limit=10, concurrency_limit=1, spend_limit=10)
    for limit in LIMITS:
        over = {column: 11 for column in limit.used}
        assert limit.refuses(account, over)
        assert not limit.refuses(account, {column: -5 for column in limit.used})  # a release never is
    assert not any(limit.refuses(account, {"input_reserved": 10, "in_flight": 1}) for limit in LIMITS)
