"""Money held like tokens: a spend limit is held in the reserving statement with tokens and concurrency,
settlement posts what the tokens cost at the prices frozen on the reservation and releases the rest, and the
money adds up (the database's checks and the audit).

Prices: input $3, cached input $0.30, output $15 per million tokens; money is in micro-dollars.
"""

from __future__ import annotations

import dataclasses
import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.db import DatabaseError, IntegrityError, connection, transaction

from budgeting.catalog.models import Price
from budgeting.catalog.prices import FrozenPrice
from ledger.errors import PriceUnavailable, QuotaExceeded
from ledger.models import CapacityAccount, LedgerEntry, Reservation, State
from ledger.selectors import audit
from ledger.services import admission, lifecycle
from tests.ledger.helpers import (
    Catalog,
    admit,
    catalog,
    now,
    pool_account,
    run_concurrently,
    spec,
    tenant_account,
)

# 1,000 input tokens cost 3,000 micro-dollars and 200 output tokens 3,000: one admission holds 6,000.
HOLD = 6_000


def priced(cat: Catalog, currency: str = "USD") -> FrozenPrice:
    price = Price.objects.create(
        model_revision=cat.model,
        effective_from=datetime(2026, 1, 1, tzinfo=UTC),
        currency=currency,
        input_per_million=Decimal("3"),
        cached_input_per_million=Decimal("0.30"),
        output_per_million=Decimal("15"),
    )
    return FrozenPrice.of(price)


def money_spec(cat: Catalog, price: FrozenPrice | None, **kwargs: Any) -> admission.AdmissionSpec:
    return dataclasses.replace(spec(cat, input_tokens=1000, output_tokens=200, **kwargs), price=price)


def _tids(cat: Catalog) -> list[int]:
    return [cat.tenant.pk]


def _dispatch(cat: Catalog, r: Reservation) -> Reservation:
    return lifecycle.dispatch(
        reservation_id=r.pk,
        tenant_ids=_tids(cat),
        fence=1,
        provider_request_id=f"p-{r.pk}",
        admitted_digest=r.admitted_digest,
        now=now(),
    )


def _usage(cat: Catalog, r: Reservation, event: str, out: int, final: bool, **kwargs: Any) -> Reservation:
    reservation, _ = lifecycle.record_usage(
        reservation_id=r.pk,
        tenant_ids=_tids(cat),
        fence=1,
        usage=lifecycle.Usage(event, out, kwargs.get("inp"), final, kwargs.get("cached")),
        now=now(),
    )
    return reservation


def money(account: CapacityAccount) -> tuple[int, int]:
    account.refresh_from_db()
    return account.spend_reserved, account.spend_consumed


@pytest.mark.django_db(transaction=True)
def test_the_hold_is_priced_and_frozen_and_settlement_posts_what_the_tokens_cost():
    cat = catalog()
    price = priced(cat)
    tenant = tenant_account(cat, spend_limit=1_000_000)
    pool = pool_account(cat)
    r = admit(money_spec(cat, price)).reservation
    r.refresh_from_db()
    assert (r.currency, r.price_id, r.input_price, r.cached_input_price, r.output_price) == (
        "USD",
        price.price_id,
        3_000_000,
        300_000,
        15_000_000,
    )
    assert (r.spend_reserved, r.spend_remaining) == (HOLD, HOLD)
    # Both accounts are in USD: the money is held on each, as tokens are.
    assert money(tenant) == money(pool) == (HOLD, 0)

    r = _dispatch(cat, r)
    assert money(tenant) == (HOLD - 3_000, 3_000)  # the input is posted at dispatch with its money
    r = _usage(cat, r, "u1", 50, False)
    r = _usage(cat, r, "u2", 70, True, inp=1000, cached=400)
    r.refresh_from_db()
    # 600 uncached × $3 + 400 cached × $0.30 + 120 output × $15, per million: 1,800 + 120 + 1,800.
    assert (r.spend_captured, r.spend_overrun) == (3_720, 0)
    assert (r.spend_remaining, r.spend_released) == (0, HOLD - 3_720)
    assert money(tenant) == money(pool) == (0, 3_720)
    entries = LedgerEntry.objects.filter(account=tenant)
    assert sum(e.spend_reserved for e in entries) == 0 and sum(e.spend_consumed for e in entries) == 3_720
    assert audit().ok


@pytest.mark.django_db(transaction=True)
def test_top_ups_hold_more_money_within_the_limit_and_overruns_are_posted():
    cat = catalog()
    price = priced(cat)
    tenant = tenant_account(cat, spend_limit=HOLD + 1_500)
    r = admit(money_spec(cat, price)).reservation
    r = _dispatch(cat, r)
    reservation, applied = lifecycle.top_up(
        reservation_id=r.pk, tenant_ids=_tids(cat), fence=1, top_up_id="t1", output_tokens=100, now=now()
    )
    assert applied and reservation.spend_reserved == HOLD + 1_500
    with pytest.raises(QuotaExceeded) as refused:
        lifecycle.top_up(
            reservation_id=r.pk, tenant_ids=_tids(cat), fence=1, top_up_id="t2", output_tokens=1, now=now()
        )
    assert refused.value.extra["dimension"] == "spend"
    assert (refused.value.extra["requested"], refused.value.extra["available"]) == (15, 0)
    # 400 output tokens against 300 held: 100 are an overrun, posted with their money.
    r = _usage(cat, reservation, "u1", 400, True)
    r.refresh_from_db()
    assert (r.spend_captured, r.spend_overrun, r.spend_released) == (HOLD + 1_500, 1_500, 0)
    assert money(tenant) == (0, HOLD + 3_000)
    assert audit().ok


@pytest.mark.django_db(transaction=True)
def test_a_money_limit_refuses_with_the_spend_dimension_and_holds_nothing():
    cat = catalog()
    price = priced(cat)
    pool = pool_account(cat)
    tenant = tenant_account(cat, spend_limit=HOLD + 100)
    admit(money_spec(cat, price))
    before = (money(pool), money(tenant), LedgerEntry.objects.count())
    with pytest.raises(QuotaExceeded) as refused:
        admit(money_spec(cat, price))
    extra = refused.value.extra
    assert extra["dimension"] == "spend" and extra["account"]["id"] == tenant.pk
    assert (extra["requested"], extra["available"]) == (HOLD, 100)
    assert (extra["currency"], extra["requestedAmount"], extra["availableAmount"]) == (
        "USD",
        "0.006000",
        "0.000100",
    )
    assert (money(pool), money(tenant), LedgerEntry.objects.count()) == before
    assert Reservation.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_no_price_in_the_accounts_currency_is_price_unavailable_never_a_free_call():
    cat = catalog()
    tenant_account(cat, spend_limit=10**9, currency="EUR")
    with pytest.raises(PriceUnavailable):
        admit(money_spec(cat, None))
    with pytest.raises(PriceUnavailable):
        admit(money_spec(cat, priced(cat, currency="USD")))
    assert Reservation.objects.count() == 0


@pytest.mark.django_db(transaction=True)
def test_the_statement_itself_refuses_an_unpriced_hold_on_a_money_limit():
    """The limit set after the account list was cached: the reserving statement still refuses it."""
    cat = catalog()
    tenant = tenant_account(cat)
    admit(money_spec(cat, None))  # caches the account list without a spend limit
    CapacityAccount.objects.filter(pk=tenant.pk).update(spend_limit=10**9)
    with pytest.raises(PriceUnavailable):
        admit(money_spec(cat, None))
    assert Reservation.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_without_a_spend_limit_an_unpriced_admission_moves_no_money():
    cat = catalog()
    tenant = tenant_account(cat, input_limit=10**6)
    r = admit(money_spec(cat, None)).reservation
    r = _usage(cat, _dispatch(cat, r), "u1", 10, True)
    assert money(tenant) == (0, 0)
    assert audit().ok


@pytest.mark.django_db(transaction=True)
def test_the_database_refuses_money_that_does_not_add_up():
    cat = catalog()
    tenant = tenant_account(cat)
    r = admit(money_spec(cat, priced(cat))).reservation
    with pytest.raises(IntegrityError), transaction.atomic():
        Reservation.objects.filter(pk=r.pk).update(spend_captured=1)
    with pytest.raises(IntegrityError), transaction.atomic():
        CapacityAccount.objects.filter(pk=tenant.pk).update(spend_reserved=-1)
    # Its spend is in USD: the account's currency cannot change under it.
    with pytest.raises(DatabaseError, match="currency cannot change"), transaction.atomic():
        CapacityAccount.objects.filter(pk=tenant.pk).update(currency="EUR")
    CapacityAccount.objects.filter(pk=pool_account(cat).pk).update(currency="EUR")  # no spend yet: fine


# PostgreSQL here allows 100 connections: 200 admissions run as 50 threads × 4, released by one barrier.
THREADS = 50
PER_THREAD = 4


def _outcomes(results: list[Any]) -> tuple[int, int, list[Any]]:
    admitted = refused = 0
    other = []
    for batch in results:
        for item in batch if isinstance(batch, list) else [batch]:
            if isinstance(item, admission.Admitted):
                admitted += 1
            elif isinstance(item, QuotaExceeded) and item.extra["dimension"] == "spend":
                refused += 1
            else:
                other.append(item)
    return admitted, refused, other


@pytest.mark.django_db(transaction=True)
def test_200_concurrent_admissions_against_a_money_budget_for_k_admit_exactly_k():
    cat = catalog()
    price = priced(cat)
    k = 37
    pool = pool_account(cat, input_limit=10**9)
    tenant = tenant_account(cat, spend_limit=k * HOLD + HOLD - 1)  # one micro-dollar short of K + 1

    def task(i: int) -> list[Any]:
        out: list[Any] = []
        for _ in range(PER_THREAD):
            try:
                out.append(admit(money_spec(cat, price)))
            except QuotaExceeded as exc:
                out.append(exc)
        return out

    admitted, refused, other = _outcomes(run_concurrently(THREADS, task))
    assert other == []
    assert (admitted, refused) == (k, THREADS * PER_THREAD - k)
    held = sum(r.spend_reserved for r in Reservation.objects.all())
    assert money(tenant) == (held, 0) and held == k * HOLD <= tenant.spend_limit
    # All or nothing across accounts: the pool holds exactly what the tenant holds, tokens and money.
    pool.refresh_from_db()
    assert (pool.spend_reserved, pool.input_reserved, pool.in_flight) == (k * HOLD, k * 1000, k)
    assert audit().ok


def _check_then_hold(account_id: int, amount: int) -> bool:
    """Negative control: read the money balance, decide in Python, then write — the race the conditional
    hold inside the reserving statement closes."""
    with transaction.atomic():
        account = CapacityAccount.objects.get(pk=account_id)
        if account.spend_reserved + amount > (account.spend_limit or 0):
            return False
        time.sleep(0.01)  # the window any server has between its read and its write
        CapacityAccount.objects.filter(pk=account_id).update(spend_reserved=account.spend_reserved + amount)
        return True


@pytest.mark.django_db(transaction=True)
def test_negative_control_a_check_then_hold_in_python_overspends_the_same_budget():
    cat = catalog()
    k = 10
    tenant = tenant_account(cat, spend_limit=k * HOLD)
    results = run_concurrently(THREADS, lambda i: _check_then_hold(tenant.pk, HOLD))
    tenant.refresh_from_db()
    # The checks of the test above catch it: more than K "admitted", and lost updates in the balance.
    assert sum(1 for r in results if r is True) > k
    assert tenant.spend_reserved < sum(1 for r in results if r is True) * HOLD
    connection.close()


@pytest.mark.django_db(transaction=True)
def test_a_refund_of_a_call_never_processed_gives_its_money_back():
    cat = catalog()
    tenant = tenant_account(cat, spend_limit=10**6)
    r = _dispatch(cat, admit(money_spec(cat, priced(cat))).reservation)
    assert money(tenant) == (HOLD - 3_000, 3_000)
    lifecycle.fail(
        reservation_id=r.pk,
        tenant_ids=_tids(cat),
        fence=1,
        reason="connect refused",
        request_sent="no",
        usage=None,
        now=now(),
    )
    r.refresh_from_db()
    assert r.state == State.SETTLED and (r.spend_captured, r.spend_released) == (0, HOLD)
    assert money(tenant) == (0, 0)
    assert audit(now() + timedelta(seconds=1)).ok
