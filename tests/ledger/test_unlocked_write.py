"""A lifecycle call's one write, on a row read without a lock (``lifecycle._written``): when another
transaction changes the reservation between the read and the write, the write applies to nothing and the call
runs again under the row's lock — never on the state it read. Real commits, the change made from a second
connection at the exact moment between the two statements."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import pytest

from ledger import locks
from ledger.errors import QuotaExceeded, StaleFence
from ledger.models import CapacityAccount, LedgerEntry, Reservation, State, TopUp
from ledger.selectors import audit
from ledger.services import lifecycle, postings
from tests.dbwork import second_connection
from tests.ledger.helpers import (
    admit,
    catalog,
    fail_unsent,
    now,
    pool_account,
    run_concurrently,
    spec,
    tenant_account,
)

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def cat():
    cat = catalog()
    tenant_account(cat, input_limit=100_000, output_limit=100_000, concurrency_limit=10)
    return cat


def between_read_and_write(monkeypatch, sql: str, params: tuple[Any, ...]) -> list[int]:
    """Commit ``sql`` from another connection right after the call's unlocked read (once); returns the list
    of the reads made, unlocked (0) or locked (1), in order."""
    reads: list[int] = []
    read, lock = locks.read_reservation, locks.lock_reservation

    def read_then_change(*args: Any) -> Reservation | None:
        found = read(*args)
        if not reads:
            with second_connection(autocommit=True) as other:
                other.execute(sql, params)
        reads.append(0)
        return found

    def locked(*args: Any) -> Reservation | None:
        reads.append(1)
        return lock(*args)

    monkeypatch.setattr(locks, "read_reservation", read_then_change)
    monkeypatch.setattr(locks, "lock_reservation", locked)
    return reads


def reclaimed_between_read_and_write_unguarded(monkeypatch, r: Reservation) -> None:
    """The negative controls' race: a reclaim (a higher fence) between the unlocked read and the write, with
    the write's version condition left out."""
    between_read_and_write(
        monkeypatch, "UPDATE ledger_reservation SET fence = fence + 1 WHERE id = %s", (r.pk,)
    )
    unguarded = postings.Postings.__init__

    def without_version(self: postings.Postings, *args: Any, **kwargs: Any) -> None:
        unguarded(self, *args, **{**kwargs, "unchanged_since": None})

    monkeypatch.setattr(postings.Postings, "__init__", without_version)


def dispatch(r: Reservation, cat: Any) -> Callable[[], Reservation]:
    return lambda: lifecycle.dispatch(
        reservation_id=r.pk,
        tenant_ids=[cat.tenant.pk],
        fence=1,
        provider_request_id=f"p-{r.pk}",
        admitted_digest=r.admitted_digest,
        now=now(),
    )


def test_a_reclaim_between_the_read_and_the_write_makes_the_call_stale(monkeypatch, cat):
    r = admit(spec(cat)).reservation
    reads = between_read_and_write(
        monkeypatch, "UPDATE ledger_reservation SET fence = fence + 1 WHERE id = %s", (r.pk,)
    )
    with pytest.raises(StaleFence):
        dispatch(r, cat)()
    # The unlocked attempt wrote nothing; the locked one saw the new fence.
    assert reads == [0, 1]
    row = Reservation.objects.get(pk=r.pk)
    assert (row.state, row.fence, row.input_consumed) == (State.RESERVED, 2, 0)
    assert not LedgerEntry.objects.filter(reservation=r, kind="POST").exists()
    assert audit().ok


def test_without_the_version_condition_the_stale_read_would_be_written(monkeypatch, cat):
    """The negative control: the same race with the write's version condition left out dispatches a
    reservation whose fence is no longer the caller's."""
    r = admit(spec(cat)).reservation
    reclaimed_between_read_and_write_unguarded(monkeypatch, r)
    dispatch(r, cat)()
    row = Reservation.objects.get(pk=r.pk)
    assert (row.state, row.fence) == (State.DISPATCHED, 2)


def test_a_concurrent_renewal_is_kept_and_the_call_goes_through_under_the_lock(monkeypatch, cat):
    r = admit(spec(cat)).reservation
    reads = between_read_and_write(
        monkeypatch,
        "UPDATE ledger_reservation SET lease_expires_at = now() + interval '1 hour' WHERE id = %s",
        (r.pk,),
    )
    done = dispatch(r, cat)()
    assert reads == [0, 1]
    row = Reservation.objects.get(pk=r.pk)
    assert row.state == State.DISPATCHED and done.state == State.DISPATCHED
    assert row.lease_expires_at is not None and row.lease_expires_at > r.lease_expires_at
    tenant = CapacityAccount.objects.get(tenant=cat.tenant)
    assert (tenant.input_reserved, tenant.input_consumed) == (0, r.input_reserved)
    assert LedgerEntry.objects.filter(reservation=r, kind="POST").count() == 1
    assert audit().ok


def test_an_unchanged_row_takes_the_unlocked_path_only(monkeypatch, cat):
    r = admit(spec(cat)).reservation
    reads: list[str] = []
    read, lock = locks.read_reservation, locks.lock_reservation
    monkeypatch.setattr(locks, "read_reservation", lambda *a: reads.append("read") or read(*a))
    monkeypatch.setattr(locks, "lock_reservation", lambda *a: reads.append("lock") or lock(*a))
    dispatch(r, cat)()
    assert reads == ["read"]
    assert Reservation.objects.get(pk=r.pk).state == State.DISPATCHED


def test_a_write_waiting_on_an_uncommitted_change_rechecks_the_version_when_it_commits(monkeypatch, cat):
    """The other transaction has changed the row but not committed when the write starts: the write waits on
    its row lock, re-checks the version on the committed row, writes nothing, and the call runs again under
    the lock."""
    r = admit(spec(cat)).reservation
    reads: list[int] = []
    read, lock = locks.read_reservation, locks.lock_reservation
    other = second_connection()

    def read_then_hold(*args: Any) -> Reservation | None:
        found = read(*args)
        if not reads:
            other.execute(
                "UPDATE ledger_reservation SET lease_expires_at = now() + interval '1 hour' WHERE id = %s",
                (r.pk,),
            )
            threading.Timer(0.5, other.commit).start()
        reads.append(0)
        return found

    monkeypatch.setattr(locks, "read_reservation", read_then_hold)
    monkeypatch.setattr(locks, "lock_reservation", lambda *a: reads.append(1) or lock(*a))
    try:
        done = dispatch(r, cat)()
    finally:
        other.close()
    assert reads == [0, 1]
    row = Reservation.objects.get(pk=r.pk)
    assert done.state == row.state == State.DISPATCHED
    assert row.lease_expires_at is not None and row.lease_expires_at > r.lease_expires_at
    assert LedgerEntry.objects.filter(reservation=r, kind="POST").count() == 1
    assert audit().ok


def test_two_usage_events_that_read_the_same_remaining_capture_it_once(monkeypatch, cat):
    """Both calls read the row before either writes (a barrier between the read and the write): the second
    write finds the row changed and runs again under the lock, so the held output is captured once and the
    rest is overrun, as two calls one after the other would do."""
    r = admit(spec(cat, output_tokens=50)).reservation
    r = dispatch(r, cat)()
    barrier = threading.Barrier(2)
    read = locks.read_reservation

    def read_together(*args: Any) -> Reservation | None:
        found = read(*args)
        with contextlib.suppress(threading.BrokenBarrierError):
            barrier.wait(timeout=10)
        return found

    monkeypatch.setattr(locks, "read_reservation", read_together)
    results = run_concurrently(
        2,
        lambda i: lifecycle.record_usage(
            reservation_id=r.pk,
            tenant_ids=[cat.tenant.pk],
            fence=1,
            usage=lifecycle.Usage(f"e{i}", 50, None, False),
            now=now(),
        ),
    )
    assert not [x for x in results if isinstance(x, Exception)], results
    row = Reservation.objects.get(pk=r.pk)
    assert (row.captured, row.overrun, row.remaining) == (50, 50, 0)
    tenant = CapacityAccount.objects.get(tenant=cat.tenant)
    assert (tenant.output_reserved, tenant.output_consumed) == (0, 100)
    assert audit().ok


def test_a_top_up_one_account_refuses_writes_nothing_on_any_account(cat):
    """The unlocked top-up is one statement: when the pool account refuses, the tenant account (which had
    room) keeps its balances too, and no top-up row or entry is left."""
    tenant = CapacityAccount.objects.get(tenant=cat.tenant)
    pool = pool_account(cat, output_limit=60)
    r = dispatch(admit(spec(cat, output_tokens=50)).reservation, cat)()
    ids = [tenant.pk, pool.pk]
    before = {a.pk: (a.output_reserved, a.spend_reserved) for a in CapacityAccount.objects.filter(pk__in=ids)}
    assert before[tenant.pk][0] == before[pool.pk][0] == 50
    with pytest.raises(QuotaExceeded) as refused:
        lifecycle.top_up(
            reservation_id=r.pk,
            tenant_ids=[cat.tenant.pk],
            fence=1,
            top_up_id="t1",
            output_tokens=20,
            now=now(),
        )
    assert refused.value.extra["dimension"] == "output"
    after = {
        a.pk: (a.output_reserved, a.spend_reserved) for a in CapacityAccount.objects.filter(pk__in=before)
    }
    assert after == before
    assert not TopUp.objects.filter(reservation=r).exists()
    assert not LedgerEntry.objects.filter(reservation=r, kind="TOP_UP").exists()
    assert Reservation.objects.get(pk=r.pk).top_ups == 0
    assert audit().ok


@pytest.mark.django_db(transaction=False)
def test_a_refused_top_up_inside_a_test_transaction_answers_quota_exceeded(cat):
    """Inside a test's transaction (where Django lets a durable block nest) the refused statement aborts its
    savepoint: the refusal is still QuotaExceeded, not the aborted transaction's InternalError (the 500
    schemathesis found)."""
    pool_account(cat, output_limit=60)
    r = dispatch(admit(spec(cat, output_tokens=50)).reservation, cat)()
    with pytest.raises(QuotaExceeded):
        lifecycle.top_up(
            reservation_id=r.pk,
            tenant_ids=[cat.tenant.pk],
            fence=1,
            top_up_id="t1",
            output_tokens=20,
            now=now(),
        )
    assert Reservation.objects.get(pk=r.pk).top_ups == 0


def test_a_refund_on_an_unchanged_row_takes_the_unlocked_path_only(monkeypatch, cat):
    r = dispatch(admit(spec(cat)).reservation, cat)()
    reads: list[str] = []
    read, lock = locks.read_reservation, locks.lock_reservation
    monkeypatch.setattr(locks, "read_reservation", lambda *a: reads.append("read") or read(*a))
    monkeypatch.setattr(locks, "lock_reservation", lambda *a: reads.append("lock") or lock(*a))
    done = fail_unsent(r, cat)()
    assert reads == ["read"]
    assert (done.state, done.input_consumed) == (State.SETTLED, 0)
    tenant = CapacityAccount.objects.get(tenant=cat.tenant)
    assert (tenant.input_reserved, tenant.input_consumed, tenant.in_flight) == (0, 0, 0)
    assert audit().ok


def test_a_reclaim_between_the_read_and_the_refund_makes_the_call_stale(monkeypatch, cat):
    r = dispatch(admit(spec(cat)).reservation, cat)()
    reads = between_read_and_write(
        monkeypatch, "UPDATE ledger_reservation SET fence = fence + 1 WHERE id = %s", (r.pk,)
    )
    with pytest.raises(StaleFence):
        fail_unsent(r, cat)()
    assert reads == [0, 1]
    row = Reservation.objects.get(pk=r.pk)
    assert (row.state, row.fence, row.input_consumed) == (State.DISPATCHED, 2, r.input_reserved)
    assert CapacityAccount.objects.get(tenant=cat.tenant).input_consumed == r.input_reserved
    assert not LedgerEntry.objects.filter(reservation=r, kind="CORRECTION").exists()
    assert audit().ok


def test_without_the_version_condition_the_stale_refund_would_be_written(monkeypatch, cat):
    """The negative control: the same race with the version condition left out refunds a reservation whose
    fence is no longer the caller's."""
    r = dispatch(admit(spec(cat)).reservation, cat)()
    reclaimed_between_read_and_write_unguarded(monkeypatch, r)
    fail_unsent(r, cat)()
    row = Reservation.objects.get(pk=r.pk)
    assert (row.state, row.fence, row.input_consumed) == (State.SETTLED, 2, 0)


def test_a_renewal_between_the_read_and_the_refund_is_kept_and_the_refund_made_once(monkeypatch, cat):
    r = dispatch(admit(spec(cat)).reservation, cat)()
    reads = between_read_and_write(
        monkeypatch,
        "UPDATE ledger_reservation SET lease_expires_at = now() + interval '1 hour' WHERE id = %s",
        (r.pk,),
    )
    done = fail_unsent(r, cat)()
    assert reads == [0, 1]
    row = Reservation.objects.get(pk=r.pk)
    assert done.state == row.state == State.SETTLED
    assert row.lease_expires_at is not None and row.lease_expires_at > r.lease_expires_at
    tenant = CapacityAccount.objects.get(tenant=cat.tenant)
    assert (tenant.input_reserved, tenant.input_consumed) == (0, 0)
    refunds = LedgerEntry.objects.filter(reservation=r, kind="CORRECTION", account=tenant)
    assert list(refunds.values_list("input_consumed", flat=True)) == [-r.input_reserved]
    assert audit().ok
