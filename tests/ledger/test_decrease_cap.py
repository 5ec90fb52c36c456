"""A decrease of a consumed balance (a refund, a downward correction) takes from an account no more than the
reservation posted into the account's current period, its earlier moves in the same statement counted: the
rest stays in the period a roll-over closed. The one statement computes it (``statements._capped_sql``), so a
refund or a final usage below the admitted input is a lifecycle call's one unlocked write like any other.

Checked against the rule written plainly in Python on random moves (tokens and money, an account in another
currency, a rolled and an unrolled period), and with a roll-over that commits while the statement waits for
the account's lock, beside its negative control."""

from __future__ import annotations

import dataclasses
import threading
import time
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from django.db import IntegrityError, connection, transaction
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from budgeting.catalog.models import Price
from budgeting.catalog.prices import FrozenPrice
from ledger import locks, statements
from ledger.models import CONSUMED_BALANCES, CapacityAccount, EntryKind, LedgerEntry, Reservation, State
from ledger.periods import period_start_for
from ledger.selectors import audit
from ledger.services import accounts, lifecycle, postings
from tests.dbwork import second_connection
from tests.ledger.helpers import Catalog, admit, catalog, now, pool_account, spec, tenant_account

pytestmark = pytest.mark.django_db(transaction=True)

OLD_PERIOD = datetime(2020, 1, 1, tzinfo=UTC)
NOTE = statements.CLOSED_PERIOD_NOTE


@dataclasses.dataclass
class Setup:
    cat: Catalog
    tenant: CapacityAccount  # in the reservations' currency
    pool: CapacityAccount  # in another currency: no money moves there


@pytest.fixture
def setup() -> Setup:
    cat = catalog()
    Price.objects.create(
        model_revision=cat.model,
        effective_from=datetime(2026, 1, 1, tzinfo=UTC),
        currency="USD",
        input_per_million=Decimal("3"),
        cached_input_per_million=Decimal("0.30"),
        output_per_million=Decimal("15"),
    )
    return Setup(cat, tenant_account(cat, currency="USD"), pool_account(cat, currency="EUR"))


def dispatched(s: Setup, *, tenant_rolls: bool = False, old_period: bool = False) -> Reservation:
    """A priced reservation dispatched (1,000 input tokens and their 3,000 micro-dollars posted) while the
    tenant account is in its current period, or with ``old_period`` in one that has ended (not rolled over
    yet); ``tenant_rolls`` rolls it over after the dispatch."""
    price = FrozenPrice.of(Price.objects.get(model_revision=s.cat.model))
    r = admit(dataclasses.replace(spec(s.cat, input_tokens=1000, output_tokens=200), price=price)).reservation
    if tenant_rolls or old_period:
        CapacityAccount.objects.filter(pk=s.tenant.pk).update(period_start=OLD_PERIOD)
    r = lifecycle.dispatch(
        reservation_id=r.pk,
        tenant_ids=[s.cat.tenant.pk],
        fence=1,
        provider_request_id=f"p-{r.pk}",
        admitted_digest=r.admitted_digest,
        now=now(),
    )
    if tenant_rolls:
        assert accounts.roll_over(account_id=s.tenant.pk, now=now())
    return r


def fail_unprocessed(s: Setup, r: Reservation) -> Reservation:
    return lifecycle.fail(
        reservation_id=r.pk,
        tenant_ids=[s.cat.tenant.pk],
        fence=1,
        reason="connection refused",
        request_sent=lifecycle.RequestSent.NO,
        usage=None,
        now=now(),
    )


def consumed(account: CapacityAccount) -> tuple[int, ...]:
    account.refresh_from_db()
    return tuple(getattr(account, column) for column in CONSUMED_BALANCES)


MOVES = st.lists(
    st.tuples(st.sampled_from(CONSUMED_BALANCES), st.integers(-4000, 4000).filter(bool)),
    min_size=1,
    max_size=6,
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(moves=MOVES, tenant_rolls=st.booleans())
def test_each_decrease_takes_no_more_than_the_period_holds_of_the_reservation(setup, moves, tenant_rolls):
    r = dispatched(setup, tenant_rolls=tenant_rolls)
    # What the reservation holds in each account's current period: its dispatch's input and the input's money
    # (money only in the reservation's currency), nothing in a period rolled over since.
    period = {
        setup.tenant.pk: dict.fromkeys(CONSUMED_BALANCES, 0)
        if tenant_rolls
        else {"input_consumed": 1000, "output_consumed": 0, "spend_consumed": 3000},
        setup.pool.pk: {"input_consumed": 1000, "output_consumed": 0, "spend_consumed": 0},
    }
    before = {pk: consumed(CapacityAccount.objects.get(pk=pk)) for pk in period}
    expected: list[tuple[int, str, int, int, int]] = []
    for n, (column, amount) in enumerate(moves):
        for pk, held in sorted(period.items()):
            asked = 0 if column == "spend_consumed" and pk == setup.pool.pk else amount
            applied = max(asked, -held[column])  # an increase is never capped
            held[column] += applied
            if applied:
                values = {c: applied if c == column else 0 for c in CONSUMED_BALANCES}
                note = NOTE if applied != asked else ""
                expected.append((pk, f"m{n}{note}", *(values[c] for c in CONSUMED_BALANCES)))
    last = LedgerEntry.objects.filter(reservation=r).order_by("-id").values_list("id", flat=True)[0]
    with transaction.atomic(durable=True):
        locked = locks.lock_reservation(r.pk)
        assert locked is not None
        posts = postings.Postings(locked, postings.held_account_ids(locked))
        for n, (column, amount) in enumerate(moves):
            posts.move(EntryKind.CORRECTION, reason=f"m{n}", **{column: amount})
        posts.flush()
    written = list(
        LedgerEntry.objects.filter(reservation=r, id__gt=last)
        .order_by("id")
        .values_list("account_id", "reason", *CONSUMED_BALANCES)
    )
    assert written == expected
    for pk in period:
        moved = [sum(e[2 + i] for e in expected if e[0] == pk) for i in range(len(CONSUMED_BALANCES))]
        after = consumed(CapacityAccount.objects.get(pk=pk))
        assert after == tuple(b + m for b, m in zip(before[pk], moved, strict=True))
        assert min(after) >= 0
    assert audit().ok


def test_a_final_usage_below_the_admitted_input_after_a_roll_over_corrects_only_the_open_period(setup):
    """The provider counted 400 input tokens fewer than dispatch posted: the correction comes off the pool's
    period (dispatch posted there), not off the tenant's new period (it posted nothing there)."""
    r = dispatched(setup, tenant_rolls=True)
    done, _ = lifecycle.record_usage(
        reservation_id=r.pk,
        tenant_ids=[setup.cat.tenant.pk],
        fence=1,
        usage=lifecycle.Usage("final", 100, 600, True),
        now=now(),
    )
    assert (done.state, done.input_consumed) == (State.SETTLED, 600)
    # 600 input and 100 output tokens cost 1,800 + 1,500 micro-dollars: 300 more than dispatch posted (in the
    # closed period), posted in the new one with the output.
    assert consumed(setup.tenant) == (0, 100, 300)
    assert consumed(setup.pool) == (600, 100, 0)
    corrections = LedgerEntry.objects.filter(reservation=r, kind=EntryKind.CORRECTION)
    assert list(corrections.values_list("account_id", "input_consumed")) == [(setup.pool.pk, -400)]
    assert audit().ok


def roll_over_uncommitted(other: psycopg.Connection[Any], account: CapacityAccount) -> None:
    """What ``accounts.roll_over`` writes (the period's consumption back to zero through a ROLLOVER entry,
    the new period's start), left uncommitted on ``other``: it holds the account's row lock."""
    account.refresh_from_db()
    start = period_start_for(account.period, now())
    other.execute(
        "INSERT INTO ledger_ledgerentry (account_id, kind, input_reserved, output_reserved, input_consumed,"
        " output_consumed, in_flight, spend_reserved, spend_consumed, period_start, reason, created_by,"
        " created_at) VALUES (%s, 'ROLLOVER', 0, 0, %s, %s, 0, 0, %s, %s, 'period closed', '', now())",
        (account.pk, -account.input_consumed, -account.output_consumed, -account.spend_consumed, start),
    )
    other.execute(
        "UPDATE ledger_capacityaccount SET input_consumed = 0, output_consumed = 0, spend_consumed = 0,"
        " period_start = %s WHERE id = %s",
        (start, account.pk),
    )


def commit_once_waiting(other: psycopg.Connection[Any], backend_pid: int, waited: list[bool]) -> None:
    """Commit ``other`` once the backend ``backend_pid`` waits for a lock (after 10 s if it never does)."""
    with second_connection(autocommit=True) as watcher:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            row = watcher.execute(
                "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (backend_pid,)
            ).fetchone()
            if row is not None and row[0] == "Lock":
                waited.append(True)
                break
            time.sleep(0.01)
    other.commit()


def refund_during_a_roll_over(s: Setup) -> tuple[Reservation | Exception, list[bool]]:
    """Dispatch, then fail with proof of non-processing while a roll-over of the tenant account holds its
    row: the refund's statement starts (its snapshot taken) before the roll-over commits and waits for it.
    Returns what the call returned or raised, and whether it was seen waiting."""
    r = dispatched(s, old_period=True)
    other = second_connection()
    waited: list[bool] = []
    try:
        roll_over_uncommitted(other, s.tenant)
        connection.ensure_connection()
        pid = connection.connection.info.backend_pid
        committer = threading.Thread(target=commit_once_waiting, args=(other, pid, waited))
        committer.start()
        try:
            return fail_unprocessed(s, r), waited
        except Exception as error:
            return error, waited
        finally:
            committer.join()
    finally:
        other.close()


def test_a_roll_over_committed_while_the_refund_waits_keeps_the_refund_in_the_closed_period(setup):
    done, waited = refund_during_a_roll_over(setup)
    assert waited == [True], "the refund's statement waited for the roll-over's lock"
    assert isinstance(done, Reservation), done
    assert (done.state, done.input_consumed, done.spend_captured) == (State.SETTLED, 0, 0)
    # The new period starts at zero and stays there; the pool's period (not rolled) is refunded.
    assert consumed(setup.tenant) == (0, 0, 0)
    assert consumed(setup.pool) == (0, 0, 0)
    refunds = LedgerEntry.objects.filter(reservation=done, kind=EntryKind.CORRECTION)
    assert list(refunds.values_list("account_id", "input_consumed")) == [(setup.pool.pk, -1000)]
    assert audit().ok


def test_without_the_locked_period_the_refund_would_be_taken_from_the_new_period(setup, monkeypatch):
    """The negative control: the posted amounts matched to the account's period as the statement's snapshot
    saw it (before the roll-over committed) take the whole refund from the new period, which the account's
    CHECK refuses (it would go negative)."""
    capped, locked = statements._capped_sql, "JOIN locked AS l ON l.id = e.account_id"
    assert locked in capped()
    snapshot = "JOIN ledger_capacityaccount AS l ON l.id = e.account_id"
    monkeypatch.setattr(statements, "_capped_sql", lambda: capped().replace(locked, snapshot))
    statements._moves_sql.cache_clear()
    try:
        done, waited = refund_during_a_roll_over(setup)
    finally:
        statements._moves_sql.cache_clear()
    assert waited == [True]
    assert isinstance(done, IntegrityError) and "account_balances_non_negative" in str(done), done
    assert Reservation.objects.get().state == State.DISPATCHED
    assert consumed(setup.tenant) == (0, 0, 0)
    assert audit().ok
