"""SPEC §5: a call whose outcome is unknown keeps its tokens held until evidence, but once it cannot still be
running (its lease expired and its pool's maximum call duration passed since dispatch) its concurrency slot
is released by the beat's reclaim step, with a ledger entry saying why. On real PostgreSQL."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import Client
from django.urls import reverse

from ledger.models import EntryKind, LedgerEntry, Reservation, State
from ledger.selectors import audit
from ledger.services import slots
from reconciliation import reclaim as reconciliation
from tests.ledger.helpers import catalog, now, tenant_account
from tests.reconciliation.helpers import dispatched, expire

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def world():
    cat = catalog()
    cat.pool.max_call_seconds = 300
    cat.pool.save()
    account = tenant_account(cat, input_limit=10**6, output_limit=10**6, concurrency_limit=100)
    return cat, account


def reconciling(cat) -> Reservation:
    """A dispatched call whose lease expired and that no lookup could settle (RECONCILING)."""
    r = dispatched(cat)
    expire(r)
    reconciliation.reclaim_expired_leases(now=now(), lookup_for=lambda pool_id: None)
    r.refresh_from_db()
    assert r.state == State.RECONCILING and r.concurrency_held
    return r


def dispatched_ago(r: Reservation, seconds: int) -> None:
    Reservation.objects.filter(pk=r.pk).update(dispatched_at=now() - timedelta(seconds=seconds))


def test_a_call_past_the_pools_maximum_duration_gives_its_slot_back_and_keeps_its_tokens(world):
    cat, account = world
    r = reconciling(cat)
    dispatched_ago(r, 301)
    expire(r)

    assert slots.free_ended_calls(now=now()) == 1

    r.refresh_from_db()
    account.refresh_from_db()
    assert (r.state, r.concurrency_held) == (State.RECONCILING, False)
    assert (account.in_flight, account.input_consumed, account.output_reserved) == (0, 100, 50)
    [entry] = LedgerEntry.objects.filter(reservation=r, kind=EntryKind.SLOT_FREE)
    assert (entry.in_flight, entry.output_reserved, entry.input_reserved) == (-1, 0, 0)
    assert "300 s" in entry.reason and "tokens stay held" in entry.reason
    assert audit().ok
    assert slots.free_ended_calls(now=now()) == 0, "a slot is freed once"


def test_a_call_that_may_still_run_keeps_its_slot(world):
    cat, account = world
    young = reconciling(cat)
    dispatched_ago(young, 299)
    expire(young)
    renewed = reconciling(cat)
    dispatched_ago(renewed, 301)
    Reservation.objects.filter(pk=renewed.pk).update(lease_expires_at=now() + timedelta(seconds=30))

    assert slots.free_ended_calls(now=now()) == 0

    account.refresh_from_db()
    assert account.in_flight == 2
    assert not LedgerEntry.objects.filter(kind=EntryKind.SLOT_FREE).exists()


def test_the_beat_step_frees_slots_and_the_backlog_shows_it(world, admin_user):
    from reconciliation import tasks

    cat, _ = world
    r = reconciling(cat)
    dispatched_ago(r, 301)
    expire(r)

    assert tasks.reclaim_expired_leases()["slotsFreed"] == 1

    browser = Client()
    browser.force_login(admin_user)
    html = browser.get(reverse("admin:ledger_reservation_backlog")).content.decode()
    assert "slot freed" in html and "1 of 1" in html
