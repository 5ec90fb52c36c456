"""Every allowed and forbidden transition of SPEC §5, through the services, on real PostgreSQL."""

from __future__ import annotations

from typing import Any

import pytest

from budgeting.catalog.errors import Conflict
from ledger.errors import (
    IdempotencyConflict,
    InvalidTransition,
    PayloadChanged,
    QuotaExceeded,
    StaleFence,
    UsageEventConflict,
)
from ledger.models import CapacityAccount, LedgerEntry, Outcome, Reservation, State
from ledger.selectors import audit
from ledger.services import accounts, admission, lifecycle
from tests.ledger.helpers import admit, catalog, now, pool_account, run_concurrently, spec, tenant_account

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def setup():
    cat = catalog()
    t = tenant_account(cat, input_limit=100_000, output_limit=100_000, concurrency_limit=10)
    p = pool_account(cat, input_limit=100_000, output_limit=100_000)
    return cat, t, p


def _tids(cat: Any) -> list[int]:
    return [cat.tenant.pk]


def reserved(cat: Any, **kw: Any) -> Reservation:
    return admit(spec(cat, input_tokens=100, output_tokens=50, **kw)).reservation


def dispatched(cat: Any) -> Reservation:
    r = reserved(cat)
    return lifecycle.dispatch(
        reservation_id=r.pk,
        tenant_ids=_tids(cat),
        fence=1,
        provider_request_id=f"p-{r.pk}",
        admitted_digest=r.admitted_digest,
        now=now(),
    )


def usage(
    cat: Any,
    r: Reservation,
    event: str,
    out: int,
    *,
    final: bool = False,
    inp: int | None = None,
    fence: int = 1,
) -> tuple[Reservation, bool]:
    return lifecycle.record_usage(
        reservation_id=r.pk,
        tenant_ids=_tids(cat),
        fence=fence,
        usage=lifecycle.Usage(event, out, inp, final),
        now=now(),
    )


def balances(account: CapacityAccount) -> tuple[int, int, int, int, int]:
    account.refresh_from_db()
    return (
        account.input_reserved,
        account.output_reserved,
        account.input_consumed,
        account.output_consumed,
        account.in_flight,
    )


def test_admit_holds_on_every_account(setup):
    cat, t, p = setup
    r = reserved(cat)
    assert r.state == State.RESERVED
    assert balances(t) == balances(p) == (100, 50, 0, 0, 1)
    assert LedgerEntry.objects.filter(reservation=r, kind="HOLD").count() == 2


def test_cancel_before_dispatch_releases_everything(setup):
    cat, t, _ = setup
    r = reserved(cat)
    r = lifecycle.cancel(reservation_id=r.pk, tenant_ids=_tids(cat), fence=1, now=now())
    assert (r.state, r.outcome) == (State.SETTLED, Outcome.RELEASED)
    assert balances(t) == (0, 0, 0, 0, 0)
    # Cancelling again is an idempotent no-op.
    lifecycle.cancel(reservation_id=r.pk, tenant_ids=_tids(cat), fence=1, now=now())
    assert audit().ok


def test_dispatch_posts_input_and_repeats_as_no_op(setup):
    cat, t, _ = setup
    r = dispatched(cat)
    assert r.state == State.DISPATCHED
    assert balances(t) == (0, 50, 100, 0, 1)
    again = lifecycle.dispatch(
        reservation_id=r.pk,
        tenant_ids=_tids(cat),
        fence=1,
        provider_request_id=r.provider_request_id,
        admitted_digest=r.admitted_digest,
        now=now(),
    )
    assert again.state == State.DISPATCHED
    assert balances(t) == (0, 50, 100, 0, 1)


def test_dispatch_with_another_digest_is_payload_changed(setup):
    cat, t, _ = setup
    r = reserved(cat)
    with pytest.raises(PayloadChanged):
        lifecycle.dispatch(
            reservation_id=r.pk,
            tenant_ids=_tids(cat),
            fence=1,
            provider_request_id="p",
            admitted_digest="sha256:" + "b" * 64,
            now=now(),
        )
    assert Reservation.objects.get(pk=r.pk).state == State.RESERVED
    assert balances(t) == (100, 50, 0, 0, 1)


def test_streaming_usage_then_final_completes(setup):
    cat, t, _ = setup
    r = dispatched(cat)
    r, applied = usage(cat, r, "e1", 10)
    assert (r.state, r.captured, r.remaining, applied) == (State.RUNNING, 10, 40, True)
    r, _ = usage(cat, r, "e2", 15, final=True, inp=90)
    assert (r.state, r.outcome) == (State.SETTLED, Outcome.COMPLETED)
    assert (r.captured, r.remaining, r.released) == (25, 0, 25)
    assert balances(t) == (0, 0, 90, 25, 0)
    assert audit().ok


def test_overrun_is_posted_and_counted(setup):
    cat, t, _ = setup
    r = dispatched(cat)
    r, _ = usage(cat, r, "e1", 80, final=True)
    assert (r.captured, r.overrun, r.remaining, r.released) == (50, 30, 0, 0)
    assert balances(t)[3] == 80
    assert audit().ok


def test_usage_replayed_100_times_sequentially_is_captured_once(setup):
    cat, t, _ = setup
    r = dispatched(cat)
    results = [usage(cat, r, "same", 7)[1] for _ in range(100)]
    assert results.count(True) == 1
    r.refresh_from_db()
    assert r.captured == 7
    assert balances(t)[3] == 7


def test_usage_replayed_concurrently_is_captured_once(setup):
    cat, _, _ = setup
    r = dispatched(cat)
    results = run_concurrently(40, lambda i: usage(cat, r, "same", 7)[1])
    assert results.count(True) == 1, results
    assert results.count(False) == 39
    r.refresh_from_db()
    assert r.captured == 7
    assert audit().ok


def test_same_event_id_with_other_amounts_conflicts_and_changes_nothing(setup):
    cat, _, _ = setup
    r = dispatched(cat)
    usage(cat, r, "e1", 7)
    with pytest.raises(UsageEventConflict):
        usage(cat, r, "e1", 8)
    r.refresh_from_db()
    assert r.captured == 7


def test_events_out_of_order_all_count(setup):
    cat, _, _ = setup
    r = dispatched(cat)
    for event, n in [("e3", 3), ("e1", 1), ("e2", 2)]:
        usage(cat, r, event, n)
    r.refresh_from_db()
    assert r.captured == 6


def test_capture_after_settlement_is_refused(setup):
    cat, _, _ = setup
    r = dispatched(cat)
    usage(cat, r, "e1", 5, final=True)
    with pytest.raises(InvalidTransition):
        usage(cat, r, "late", 5)


def test_stale_fence_is_refused_everywhere(setup):
    cat, _, _ = setup
    r = dispatched(cat)
    Reservation.objects.filter(pk=r.pk).update(fence=2)
    with pytest.raises(StaleFence):
        usage(cat, r, "e1", 5, fence=1)
    with pytest.raises(StaleFence):
        lifecycle.cancel(reservation_id=r.pk, tenant_ids=_tids(cat), fence=1, now=now())
    with pytest.raises(StaleFence):
        lifecycle.renew_lease(reservation_id=r.pk, tenant_ids=_tids(cat), fence=1)
    r.refresh_from_db()
    assert r.captured == 0


def test_cancel_after_dispatch_settles_consumed_keeps_rest_held_and_frees_the_slot(setup):
    cat, t, _ = setup
    r = dispatched(cat)
    usage(cat, r, "e1", 20)
    r = lifecycle.cancel(reservation_id=r.pk, tenant_ids=_tids(cat), fence=1, now=now())
    assert r.state == State.PARTIALLY_SETTLED
    assert (r.captured, r.remaining, r.released, r.concurrency_held) == (20, 30, 0, False)
    # The gateway cancelled: the call stopped, so its slot goes (SPEC §5); the unknown output stays held.
    assert balances(t) == (0, 30, 100, 20, 0)
    assert r.entries.filter(kind="SLOT_FREE", in_flight=-1).count() == r.holds.count()
    r, _ = usage(cat, r, "final", 5, final=True)
    assert (r.state, r.outcome, r.released) == (State.SETTLED, Outcome.COMPLETED, 25)
    assert balances(t) == (0, 0, 100, 25, 0)


def test_failure_with_proof_of_non_processing_releases_and_refunds(setup):
    cat, t, _ = setup
    r = dispatched(cat)
    r = lifecycle.fail(
        reservation_id=r.pk,
        tenant_ids=_tids(cat),
        fence=1,
        reason="connection refused",
        request_sent=lifecycle.RequestSent.NO,
        usage=None,
        now=now(),
    )
    assert (r.state, r.outcome, r.input_consumed) == (State.SETTLED, Outcome.RELEASED, 0)
    assert balances(t) == (0, 0, 0, 0, 0)
    assert audit().ok


@pytest.mark.parametrize("sent", [lifecycle.RequestSent.YES, lifecycle.RequestSent.UNKNOWN])
def test_failure_without_proof_keeps_the_tokens_held(setup, sent):
    cat, t, _ = setup
    r = dispatched(cat)
    r = lifecycle.fail(
        reservation_id=r.pk,
        tenant_ids=_tids(cat),
        fence=1,
        reason="timeout",
        request_sent=sent,
        usage=lifecycle.Usage("fail-usage", 4, None, False),
        now=now(),
    )
    assert r.state == State.PARTIALLY_SETTLED
    assert (r.captured, r.remaining) == (4, 46)
    # The provider answered (sent: yes): the call ended and its slot goes; sent-or-not unknown may still run.
    in_flight = 0 if sent == lifecycle.RequestSent.YES else 1
    assert balances(t) == (0, 46, 100, 4, in_flight), "unknown is never released as zero"
    assert r.concurrency_held is (in_flight == 1)
    assert r.entries.filter(kind="SLOT_FREE").count() == (1 - in_flight) * r.holds.count()


def fail_with_usage(cat: Any, r: Reservation, event: str, out: int) -> Reservation:
    return lifecycle.fail(
        reservation_id=r.pk,
        tenant_ids=_tids(cat),
        fence=1,
        reason="stream broke",
        request_sent=lifecycle.RequestSent.YES,
        usage=lifecycle.Usage(event, out, None, False),
        now=now(),
    )


def test_a_failure_repeating_a_recorded_usage_event_settles_without_capturing_it_again(setup):
    cat, t, _ = setup
    r, _ = usage(cat, dispatched(cat), "e1", 4)
    r = fail_with_usage(cat, r, "e1", 4)
    assert r.state == State.PARTIALLY_SETTLED
    assert (r.captured, r.remaining, r.usage_events.count()) == (4, 46, 1)
    assert balances(t) == (0, 46, 100, 4, 0), "the call ended: its slot is free"
    assert audit().ok


def test_a_failure_with_a_usage_event_recorded_with_other_amounts_is_a_conflict_and_writes_nothing(setup):
    cat, t, _ = setup
    r, _ = usage(cat, dispatched(cat), "e1", 4)
    with pytest.raises(UsageEventConflict) as err:
        fail_with_usage(cat, r, "e1", 9)
    assert err.value.extra["recorded"] == {"outputTokens": 4, "inputTokens": None}
    r.refresh_from_db()
    assert (r.state, r.captured) == (State.RUNNING, 4)
    assert balances(t) == (0, 46, 100, 4, 1)


def fail_report(cat: Any, r: Reservation, sent: str, reason: str = "connection refused") -> Reservation:
    return lifecycle.fail(
        reservation_id=r.pk, tenant_ids=_tids(cat), fence=1, reason=reason, request_sent=sent, usage=None,
        now=now(),
    )  # fmt: skip


@pytest.mark.parametrize("first", [lifecycle.RequestSent.NO, lifecycle.RequestSent.UNKNOWN])
def test_a_failure_repeated_is_answered_as_before_and_a_different_one_is_refused(setup, first):
    """A retry of the same report changes nothing; another report (say, the request was sent after all)
    would be lost if it were answered as one: it is refused, and nothing is written."""
    cat, t, _ = setup
    r = fail_report(cat, dispatched(cat), first)
    entries, before = LedgerEntry.objects.count(), balances(t)
    assert fail_report(cat, r, first).failure_reason == r.failure_reason
    other = lifecycle.RequestSent.YES
    for sent, reason in [(other, "connection refused"), (first, "a different reason")]:
        with pytest.raises(InvalidTransition, match="already failed as"):
            fail_report(cat, r, sent, reason)
    r.refresh_from_db()
    assert (LedgerEntry.objects.count(), balances(t)) == (entries, before)
    assert audit().ok


def test_a_failure_reason_as_long_as_the_api_takes_is_kept_cut_to_the_column(setup):
    cat, _, _ = setup
    reason = "r" * 300
    r = fail_report(cat, dispatched(cat), lifecycle.RequestSent.UNKNOWN, reason)
    assert r.failure_reason == f"failed (unknown sent): {reason}"[:300]
    assert fail_report(cat, r, lifecycle.RequestSent.UNKNOWN, reason).pk == r.pk


def test_failure_before_dispatch_releases(setup):
    cat, t, _ = setup
    r = reserved(cat)
    r = lifecycle.fail(
        reservation_id=r.pk,
        tenant_ids=_tids(cat),
        fence=1,
        reason="gateway crashed",
        request_sent=lifecycle.RequestSent.UNKNOWN,
        usage=None,
        now=now(),
    )
    assert (r.state, r.outcome) == (State.SETTLED, Outcome.RELEASED)
    assert balances(t) == (0, 0, 0, 0, 0)


def test_top_up_extends_and_is_idempotent(setup):
    cat, t, _ = setup
    r = dispatched(cat)
    lifecycle.top_up(
        reservation_id=r.pk, tenant_ids=_tids(cat), fence=1, top_up_id="u1", output_tokens=30, now=now()
    )
    r2, applied = lifecycle.top_up(
        reservation_id=r.pk, tenant_ids=_tids(cat), fence=1, top_up_id="u1", output_tokens=30, now=now()
    )
    assert not applied
    assert (r2.top_ups, r2.remaining) == (30, 80)
    assert balances(t)[1] == 80
    r3, _ = usage(cat, r2, "e", 70, final=True)
    assert (r3.captured, r3.released, r3.overrun) == (70, 10, 0)
    assert audit().ok


def test_top_up_beyond_capacity_is_quota_exceeded(setup):
    cat, t, _ = setup
    r = dispatched(cat)
    with pytest.raises(QuotaExceeded) as err:
        lifecycle.top_up(
            reservation_id=r.pk,
            tenant_ids=_tids(cat),
            fence=1,
            top_up_id="big",
            output_tokens=200_000,
            now=now(),
        )
    assert err.value.extra["dimension"] == "output"
    assert balances(t)[1] == 50


FORBIDDEN = [
    ("reserved", "usage"),
    ("settled", "dispatch"),
    ("settled", "usage"),
    ("settled", "top_up"),
    ("partial", "dispatch"),
    ("partial", "top_up"),
]


@pytest.mark.parametrize(("where", "action"), FORBIDDEN)
def test_forbidden_transitions_are_refused_and_change_nothing(setup, where, action):
    cat, t, _ = setup
    r = reserved(cat) if where == "reserved" else dispatched(cat)
    if where == "settled":
        usage(cat, r, "fin", 1, final=True)
    if where == "partial":
        lifecycle.cancel(reservation_id=r.pk, tenant_ids=_tids(cat), fence=1, now=now())
    before = (balances(t), LedgerEntry.objects.count())
    with pytest.raises(InvalidTransition):
        if action == "usage":
            usage(cat, r, "x", 1)
        elif action == "dispatch":
            lifecycle.dispatch(
                reservation_id=r.pk,
                tenant_ids=_tids(cat),
                fence=1,
                provider_request_id="other",
                admitted_digest=r.admitted_digest,
                now=now(),
            )
        else:
            lifecycle.top_up(
                reservation_id=r.pk, tenant_ids=_tids(cat), fence=1, top_up_id="t", output_tokens=1, now=now()
            )
    assert (balances(t), LedgerEntry.objects.count()) == before


def test_idempotent_admission_sequential_and_concurrent(setup):
    cat, t, _ = setup
    first = admit(spec(cat, key="k1"))
    replays = [admit(spec(cat, key="k1")) for _ in range(50)]
    assert all(a.replayed and a.reservation.pk == first.reservation.pk for a in replays)
    results = run_concurrently(50, lambda i: admit(spec(cat, key="k2")))
    ids = {a.reservation.pk for a in results}
    assert len(ids) == 1
    assert sum(1 for a in results if not a.replayed) == 1
    assert Reservation.objects.count() == 2
    assert balances(t)[0] == 200


def test_idempotency_conflict_on_other_digest_and_keys_scoped_per_tenant(setup):
    cat, _, _ = setup
    admit(spec(cat, key="k"))
    with pytest.raises(IdempotencyConflict):
        admit(spec(cat, key="k", digest="sha256:" + "c" * 64))
    other = catalog(tenant_slug="t-2")
    assert not admit(spec(other, key="k")).replayed


def test_queue_when_short_then_admitted_when_capacity_frees(setup):
    cat, t, _ = setup
    CapacityAccount.objects.filter(pk=t.pk).update(concurrency_limit=1)
    first = reserved(cat)
    queued = admit(spec(cat, queue=True)).reservation
    assert queued.state == State.PROPOSED
    assert admission.admit_queued(reservation_id=queued.pk, build_body=lambda r: {}, now=now()) is None
    lifecycle.cancel(reservation_id=first.pk, tenant_ids=_tids(cat), fence=1, now=now())
    admitted = admission.admit_queued(reservation_id=queued.pk, build_body=lambda r: {}, now=now())
    assert admitted is not None and admitted.state == State.RESERVED
    assert balances(t)[4] == 1
    assert audit().ok


def test_queued_request_rejected_at_deadline(setup):
    cat, t, _ = setup
    CapacityAccount.objects.filter(pk=t.pk).update(concurrency_limit=0)
    queued = admit(spec(cat, queue=True)).reservation
    Reservation.objects.filter(pk=queued.pk).update(queue_deadline=now().replace(year=2020))
    result = admission.admit_queued(reservation_id=queued.pk, build_body=lambda r: {}, now=now())
    assert result is not None and result.state == State.REJECTED


def test_ledger_rows_cannot_be_edited():
    from django.db import DatabaseError, transaction

    cat = catalog()
    tenant_account(cat)
    r = reserved(cat)
    entry = LedgerEntry.objects.filter(reservation=r).first()
    assert entry is not None
    with pytest.raises(DatabaseError), transaction.atomic():
        LedgerEntry.objects.filter(pk=entry.pk).update(input_reserved=0)


def test_a_refund_after_the_period_rolled_over_stays_in_the_closed_period(setup):
    """Input consumed in the old period and refunded after the roll-over must not drive the new period's
    consumption negative (the dispatch happened before the account was rolled)."""
    from datetime import UTC, datetime

    cat, t, p = setup
    r = reserved(cat)
    CapacityAccount.objects.filter(pk=t.pk).update(period_start=datetime(2020, 1, 1, tzinfo=UTC))
    lifecycle.dispatch(
        reservation_id=r.pk,
        tenant_ids=_tids(cat),
        fence=1,
        provider_request_id=f"p-{r.pk}",
        admitted_digest=r.admitted_digest,
        now=now(),
    )
    assert accounts.roll_over(account_id=t.pk, now=now())
    assert balances(t)[2] == 0, "the new period starts with nothing consumed"
    r = lifecycle.fail(
        reservation_id=r.pk,
        tenant_ids=_tids(cat),
        fence=1,
        reason="connection refused",
        request_sent=lifecycle.RequestSent.NO,
        usage=None,
        now=now(),
    )
    assert (r.state, r.outcome) == (State.SETTLED, Outcome.RELEASED)
    assert balances(t) == (0, 0, 0, 0, 0), "the refund stayed in the closed period"
    assert balances(p) == (0, 0, 0, 0, 0), "the pool's period did not roll: refunded there"
    assert audit().ok


def test_a_top_up_is_not_refused_for_a_dimension_it_does_not_ask_for(setup):
    cat, t, _ = setup
    r = dispatched(cat)
    CapacityAccount.objects.filter(pk=t.pk).update(input_limit=1)  # finance lowered input below its use
    r2, applied = lifecycle.top_up(
        reservation_id=r.pk, tenant_ids=_tids(cat), fence=1, top_up_id="t", output_tokens=10, now=now()
    )
    assert applied and r2.top_ups == 10


def test_input_is_reported_once_and_a_different_figure_is_refused(setup):
    cat, t, _ = setup
    r = dispatched(cat)
    usage(cat, r, "e1", 5, inp=90)
    with pytest.raises(UsageEventConflict) as err:
        usage(cat, r, "e2", 5, inp=0)
    assert err.value.code == "INPUT_ALREADY_REPORTED"
    r.refresh_from_db()
    assert (r.input_consumed, r.captured) == (90, 5)
    assert balances(t)[2] == 90


def test_a_provider_request_id_names_one_call(setup):
    cat, _, _ = setup
    first = dispatched(cat)
    second = reserved(cat)
    with pytest.raises(Conflict) as err:
        lifecycle.dispatch(
            reservation_id=second.pk,
            tenant_ids=_tids(cat),
            fence=1,
            provider_request_id=first.provider_request_id,
            admitted_digest=second.admitted_digest,
            now=now(),
        )
    assert err.value.code == "PROVIDER_REQUEST_ID_IN_USE"
    assert Reservation.objects.get(pk=second.pk).state == State.RESERVED


def test_an_integrity_error_other_than_the_provider_id_is_not_disguised(setup):
    from django.db import IntegrityError

    cat, t, _ = setup
    r = reserved(cat)
    CapacityAccount.objects.filter(pk=t.pk).update(input_reserved=0)  # a dispatch would now go negative
    with pytest.raises(IntegrityError):
        lifecycle.dispatch(
            reservation_id=r.pk,
            tenant_ids=_tids(cat),
            fence=1,
            provider_request_id="p-x",
            admitted_digest=r.admitted_digest,
            now=now(),
        )
