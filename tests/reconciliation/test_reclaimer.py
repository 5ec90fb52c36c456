"""Leases and the reclaimer on real PostgreSQL, with the provider simulator answering lookups over HTTP."""

from __future__ import annotations

from datetime import timedelta

import pytest

from ledger.errors import StaleFence
from ledger.models import Outcome, Reservation, State
from ledger.selectors import audit
from ledger.services import lifecycle, settlement
from reconciliation import reclaim as reconciliation
from reconciliation.providers.simulator import SimulatorLookup
from simulation.provider import Simulator
from tests.ledger.helpers import admit, catalog, now, run_concurrently, spec, tenant_account
from tests.reconciliation.helpers import call_provider, dispatched, expire

pytestmark = pytest.mark.django_db(transaction=True)


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


def lookup_for(sim):
    return lambda pool_id: SimulatorLookup(sim.base_url, timeout=2)


def test_expired_reserved_without_dispatch_record_is_released_in_full(world, sim):
    cat, account = world
    r = admit(spec(cat)).reservation
    expire(r)
    report = reconciliation.reclaim_expired_leases(now=now(), lookup_for=lookup_for(sim))
    r.refresh_from_db()
    assert report.released == 1
    assert (r.state, r.outcome, r.fence) == (State.SETTLED, Outcome.RELEASED, 2)
    account.refresh_from_db()
    assert (account.input_reserved, account.output_reserved, account.in_flight) == (0, 0, 0)


def test_unexpired_leases_are_left_alone(world, sim):
    cat, _ = world
    r = dispatched(cat)
    report = reconciliation.reclaim_expired_leases(now=now(), lookup_for=lookup_for(sim))
    assert report.frozen == report.released == 0
    assert Reservation.objects.get(pk=r.pk).state == State.DISPATCHED


def test_dispatched_and_completed_at_the_provider_is_settled_at_billed_usage(world, sim):
    cat, _ = world
    r = dispatched(cat)
    call_provider(sim, r.provider_request_id, max_tokens=20)
    billed = sim.entry(r.provider_request_id)
    assert billed is not None
    expire(r)
    report = reconciliation.reclaim_expired_leases(now=now(), lookup_for=lookup_for(sim))
    r.refresh_from_db()
    assert report.settled == 1
    assert (r.state, r.outcome) == (State.SETTLED, Outcome.RECONCILED)
    assert r.input_consumed == billed.prompt_tokens
    assert r.captured + r.overrun == billed.completion_tokens
    assert audit().ok


def test_dispatched_but_never_processed_is_released_with_input_refunded(world, sim):
    cat, account = world
    r = dispatched(cat)
    expire(r)
    reconciliation.reclaim_expired_leases(now=now(), lookup_for=lookup_for(sim))
    r.refresh_from_db()
    assert (r.state, r.outcome, r.input_consumed) == (State.SETTLED, Outcome.RELEASED, 0)
    account.refresh_from_db()
    assert (account.input_consumed, account.output_reserved, account.in_flight) == (0, 0, 0)


def test_unknown_outcome_is_frozen_in_reconciling_and_nothing_is_released(world, sim):
    cat, account = world
    r = dispatched(cat)
    sim.script_lookup("http_500", count=5)
    expire(r)
    report = reconciliation.reclaim_expired_leases(now=now(), lookup_for=lookup_for(sim))
    r.refresh_from_db()
    assert report.still_unknown == 1
    assert (r.state, r.fence) == (State.RECONCILING, 2)
    account.refresh_from_db()
    assert (account.input_consumed, account.output_reserved, account.in_flight) == (100, 50, 1)
    with pytest.raises(StaleFence):
        lifecycle.record_usage(
            reservation_id=r.pk,
            tenant_ids=[cat.tenant.pk],
            fence=1,
            usage=lifecycle.Usage("late", 5, None, True),
            now=now(),
        )
    # A later lookup with the provider reachable again resolves it.
    Reservation.objects.filter(pk=r.pk).update(lease_expires_at=now() - timedelta(seconds=1))
    sim.clear_scripts()
    call_provider(sim, r.provider_request_id)
    later = reconciliation.lookup_unknown_outcomes(now=now(), lookup_for=lookup_for(sim))
    assert later.settled == 1
    assert Reservation.objects.get(pk=r.pk).outcome == Outcome.RECONCILED


def test_no_adapter_configured_means_it_stays_reconciling(world):
    cat, _ = world
    r = dispatched(cat)
    expire(r)
    reconciliation.reclaim_expired_leases(now=now(), lookup_for=lambda pool_id: None)
    assert Reservation.objects.get(pk=r.pk).state == State.RECONCILING


def test_two_reclaimers_at_once_take_each_row_once(world, sim):
    cat, _ = world
    rows = [admit(spec(cat)).reservation for _ in range(30)]
    for r in rows:
        expire(r)
    reports = run_concurrently(
        6, lambda i: reconciliation.reclaim_expired_leases(now=now(), lookup_for=lookup_for(sim))
    )
    assert sum(rep.released for rep in reports) == 30
    assert set(Reservation.objects.values_list("fence", flat=True)) == {2}, (
        "each row was taken over exactly once"
    )
    assert audit().ok


def test_a_frozen_lease_holder_resuming_after_takeover_is_refused_everywhere(world, sim):
    cat, _ = world
    r = dispatched(cat)
    sim.script_lookup("unknown", count=3)
    expire(r)
    reconciliation.reclaim_expired_leases(now=now(), lookup_for=lookup_for(sim))
    ids = [cat.tenant.pk]
    for call in (
        lambda: lifecycle.record_usage(
            reservation_id=r.pk,
            tenant_ids=ids,
            fence=1,
            usage=lifecycle.Usage("e", 5, None, False),
            now=now(),
        ),
        lambda: lifecycle.cancel(reservation_id=r.pk, tenant_ids=ids, fence=1, now=now()),
        lambda: lifecycle.fail(
            reservation_id=r.pk, tenant_ids=ids, fence=1, reason="x", request_sent="no", usage=None, now=now()
        ),
        lambda: lifecycle.renew_lease(reservation_id=r.pk, tenant_ids=ids, fence=1),
        lambda: lifecycle.top_up(
            reservation_id=r.pk, tenant_ids=ids, fence=1, top_up_id="t", output_tokens=5, now=now()
        ),
    ):
        with pytest.raises(StaleFence):
            call()
    assert Reservation.objects.get(pk=r.pk).state == State.RECONCILING


def test_evidence_for_a_moved_fence_is_not_applied(world, sim):
    cat, _ = world
    r = dispatched(cat)
    sim.script_lookup("unknown", count=3)
    expire(r)
    _, claims = settlement.claim_expired_leases(now=now())
    Reservation.objects.filter(pk=r.pk).update(fence=5)
    result = settlement.settle_from_evidence(
        reservation_id=claims[0].reservation_id,
        fence=claims[0].fence,
        evidence=settlement.Evidence("NOT_PROCESSED"),
        now=now(),
    )
    assert result is None
    assert Reservation.objects.get(pk=r.pk).state == State.RECONCILING
