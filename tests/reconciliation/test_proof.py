"""Proof means proof (issue 11, items 10 and 11): "not found" releases a call only when the adapter can vouch
for it, and a call whose evidence contradicts our record goes to a person, who resolves it in the ledger."""

from __future__ import annotations

import pytest

from budgeting.catalog.changes import Actor
from budgeting.catalog.errors import InvalidInput
from budgeting.catalog.models import ChangeRecord
from ledger.errors import InvalidTransition
from ledger.models import Outcome, Reservation, State
from ledger.selectors import audit
from ledger.services import lifecycle, settlement
from reconciliation import reclaim
from simulation.provider import Simulator
from tests.ledger.helpers import catalog, now, tenant_account
from tests.reconciliation.helpers import call_provider, dispatched, expire

pytestmark = pytest.mark.django_db(transaction=True)

FINANCE = Actor(user_id=None, username="finance-1")


@pytest.fixture
def sim():
    simulator = Simulator(seed=3)
    simulator.start()
    yield simulator
    simulator.stop()


@pytest.fixture
def world(sim):
    cat = catalog()
    cat.pool.provider_base_url = sim.base_url
    cat.pool.save()
    account = tenant_account(cat, input_limit=10**6, output_limit=10**6, concurrency_limit=100)
    return cat, account


def freeze(r: Reservation, sim: Simulator) -> None:
    """Expire the lease while the provider's lookup is down: the reservation goes RECONCILING."""
    sim.script_lookup("http_500", count=1)
    expire(r)
    reclaim.reclaim_expired_leases(now=now())
    r.refresh_from_db()
    assert r.state == State.RECONCILING


def test_a_new_provider_behind_the_pool_refunds_nothing(world, sim):
    cat, account = world
    calls = [dispatched(cat) for _ in range(3)]
    for r in calls:
        freeze(r, sim)
    with Simulator(seed=4) as replacement:
        cat.pool.provider_base_url = replacement.base_url
        cat.pool.save()
        for r in calls:
            expire(r)
        report = reclaim.lookup_unknown_outcomes(now=now())
        assert report.refunded == 0 and report.needs_person == 3
    account.refresh_from_db()
    assert (account.input_consumed, account.output_reserved) == (300, 150), "nothing refunded"
    for r in calls:
        r.refresh_from_db()
        assert r.state == State.RECONCILING
        assert r.provider_endpoint == sim.base_url
        assert "the pool now names" in r.needs_person
    assert audit().ok


def failed(cat, request_sent: str) -> Reservation:
    """A dispatched call whose gateway reported a failure, its lease then expired."""
    r = dispatched(cat)
    lifecycle.fail(
        reservation_id=r.pk,
        tenant_ids=[cat.tenant.pk],
        fence=1,
        reason="read timeout",
        request_sent=request_sent,
        usage=None,
        now=now(),
    )
    expire(r)
    return r


def contradicted(cat) -> Reservation:
    """A call with captured usage that the provider has never seen, after its lease expired."""
    r = dispatched(cat)
    usage = lifecycle.Usage("u1", 20, None, False)
    lifecycle.record_usage(reservation_id=r.pk, tenant_ids=[cat.tenant.pk], fence=1, usage=usage, now=now())
    expire(r)
    reclaim.reclaim_expired_leases(now=now())  # the simulator never saw it: "not found"
    r.refresh_from_db()
    return r


def test_a_gateway_that_said_sent_then_not_found_stays_reconciling(world, sim):
    cat, account = world
    r = failed(cat, "yes")
    report = reclaim.reclaim_expired_leases(now=now())
    r.refresh_from_db()
    assert report.refunded == 0 and report.needs_person == 1
    assert (r.state, r.request_sent, r.input_consumed) == (State.RECONCILING, "yes", 100)
    assert "reported the request sent" in r.needs_person
    account.refresh_from_db()
    assert account.input_consumed == 100


def test_not_found_is_still_proof_when_the_adapter_can_vouch(world, sim):
    cat, _ = world
    r = failed(cat, "unknown")
    report = reclaim.reclaim_expired_leases(now=now())
    r.refresh_from_db()
    assert report.refunded == 1
    assert (r.state, r.outcome, r.input_consumed) == (State.SETTLED, Outcome.RELEASED, 0)


def test_evidence_that_contradicts_captured_usage_goes_to_a_person_and_is_not_looked_up_again(world, sim):
    cat, _ = world
    r = contradicted(cat)
    assert r.state == State.RECONCILING and r.captured == 20
    assert "never processed" in r.needs_person and r.needs_person_since is not None
    assert list(settlement.needing_a_person()) == [r]
    fence = r.fence
    later = reclaim.lookup_unknown_outcomes(now=now())
    assert later.still_unknown == later.refunded == later.settled == 0
    assert Reservation.objects.get(pk=r.pk).fence == fence, "no longer claimed for lookups"


def test_a_person_resolves_it_as_not_processed_with_compensating_entries(world, sim):
    cat, account = world
    r = contradicted(cat)
    done = settlement.resolve_for_person(
        reservation_id=r.pk,
        resolution=settlement.Resolution.NOT_PROCESSED,
        actor=FINANCE,
        reason="provider support confirmed it never ran",
        now=now(),
    )
    assert (done.state, done.outcome, done.input_consumed, done.captured) == (
        State.SETTLED,
        Outcome.RELEASED,
        0,
        0,
    )
    account.refresh_from_db()
    assert (account.input_consumed, account.output_consumed, account.output_reserved, account.in_flight) == (
        0,
        0,
        0,
        0,
    )
    change = ChangeRecord.objects.get(target_id=str(r.pk))
    assert change.actor_username == "finance-1" and change.action == "reservation.resolve.not_processed"
    assert change.before["captured"] == 20 and change.after["outcome"] == Outcome.RELEASED
    assert change.reason == "provider support confirmed it never ran"
    assert not settlement.needing_a_person().exists()
    assert audit().ok


def test_a_person_resolves_it_at_the_billed_usage(world, sim):
    cat, account = world
    r = contradicted(cat)
    done = settlement.resolve_for_person(
        reservation_id=r.pk,
        resolution=settlement.Resolution.AS_BILLED,
        actor=FINANCE,
        reason="invoice line 42",
        input_tokens=90,
        output_tokens=35,
        now=now(),
    )
    assert (done.state, done.outcome, done.input_consumed, done.captured + done.overrun) == (
        State.SETTLED,
        Outcome.RECONCILED,
        90,
        35,
    )
    account.refresh_from_db()
    assert (account.input_consumed, account.output_consumed, account.output_reserved) == (90, 35, 0)
    assert audit().ok


def test_a_person_keeps_what_we_recorded(world, sim):
    cat, account = world
    r = contradicted(cat)
    done = settlement.resolve_for_person(
        reservation_id=r.pk,
        resolution=settlement.Resolution.AS_RECORDED,
        actor=FINANCE,
        reason="usage events are right",
        now=now(),
    )
    assert (done.outcome, done.input_consumed, done.captured) == (Outcome.RECONCILED, 100, 20)
    account.refresh_from_db()
    assert (account.input_consumed, account.output_consumed, account.output_reserved) == (100, 20, 0)
    assert audit().ok


def test_a_resolution_needs_a_reason_amounts_where_billed_and_a_reconciling_reservation(world, sim):
    cat, _ = world
    r = contradicted(cat)
    resolve = settlement.resolve_for_person
    with pytest.raises(InvalidInput):
        resolve(reservation_id=r.pk, resolution="AS_RECORDED", actor=FINANCE, reason=" ", now=now())
    with pytest.raises(InvalidInput):
        resolve(reservation_id=r.pk, resolution="AS_BILLED", actor=FINANCE, reason="x", now=now())
    with pytest.raises(InvalidInput):
        resolve(
            reservation_id=r.pk,
            resolution="NOT_PROCESSED",
            actor=FINANCE,
            reason="x",
            input_tokens=1,
            now=now(),
        )
    settled = dispatched(cat)
    call_provider(sim, settled.provider_request_id)
    with pytest.raises(InvalidTransition):
        resolve(reservation_id=settled.pk, resolution="AS_RECORDED", actor=FINANCE, reason="x", now=now())
    assert Reservation.objects.get(pk=r.pk).state == State.RECONCILING
