"""No overspend under contention: real PostgreSQL, real commits, threads released by a barrier.

PostgreSQL here allows 100 connections, so 200 admissions run as 50 threads × 4 admissions each, all
threads released together by one barrier.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from django.db import connection, transaction

from ledger.errors import QuotaExceeded
from ledger.models import CapacityAccount, LedgerEntry, Reservation, Scope
from ledger.selectors import audit
from ledger.services import admission
from tests.dbwork import second_connection
from tests.ledger.helpers import admit, catalog, pool_account, run_concurrently, spec, tenant_account

pytestmark = pytest.mark.django_db(transaction=True)

THREADS = 50
PER_THREAD = 4


def _outcomes(results: list[Any]) -> tuple[int, int, list[Any]]:
    admitted = quota = 0
    other = []
    for batch in results:
        for item in batch if isinstance(batch, list) else [batch]:
            if isinstance(item, admission.Admitted):
                admitted += 1
            elif isinstance(item, QuotaExceeded):
                quota += 1
            else:
                other.append(item)
    return admitted, quota, other


def _attempts(cat: Any, sizes: list[int]) -> Any:
    def task(i: int) -> list[Any]:
        out: list[Any] = []
        for j in range(PER_THREAD):
            try:
                out.append(admit(spec(cat, input_tokens=sizes[i * PER_THREAD + j], output_tokens=10)))
            except QuotaExceeded as exc:
                out.append(exc)
        return out

    return task


def test_exactly_k_admitted_of_200_with_zero_overspend():
    cat = catalog()
    k = 37
    account = tenant_account(cat, input_limit=k * 100)
    results = run_concurrently(THREADS, _attempts(cat, [100] * (THREADS * PER_THREAD)))
    admitted, quota, other = _outcomes(results)
    assert other == []
    assert (admitted, quota) == (k, THREADS * PER_THREAD - k)
    account.refresh_from_db()
    assert account.input_reserved == k * 100 <= account.input_limit
    assert Reservation.objects.count() == k
    assert audit().ok


def test_random_sizes_never_overspend():
    cat = catalog()
    limit = 25_000
    account = tenant_account(cat, input_limit=limit)
    rng = random.Random(7)
    sizes = [rng.randint(50, 900) for _ in range(THREADS * PER_THREAD)]
    results = run_concurrently(THREADS, _attempts(cat, sizes))
    admitted, quota, other = _outcomes(results)
    assert other == []
    account.refresh_from_db()
    held = sum(r.input_reserved for r in Reservation.objects.all())
    assert account.input_reserved == held <= limit
    assert admitted + quota == THREADS * PER_THREAD
    assert quota > 0, "the limit must actually bind for the test to mean anything"
    assert audit().ok


def test_tenant_cap_shared_by_several_pools_has_no_write_skew():
    """Each pool has room; only the shared tenant account limits. Write skew would overspend the tenant."""
    cats = [catalog(pool_slug=f"pool-{i}") for i in range(4)]
    tenant = tenant_account(cats[0], input_limit=3000)
    for cat in cats:
        pool_account(cat, input_limit=10**9)

    def task(i: int) -> list[Any]:
        out: list[Any] = []
        for _ in range(PER_THREAD):
            try:
                out.append(admit(spec(cats[i % 4], input_tokens=100, output_tokens=1)))
            except QuotaExceeded as exc:
                out.append(exc)
        return out

    admitted, _, other = _outcomes(run_concurrently(THREADS, task))
    assert other == []
    tenant.refresh_from_db()
    assert admitted == 30
    assert tenant.input_reserved == 3000
    assert audit().ok


def test_first_request_creating_a_brand_new_account_from_many_threads():
    cat = catalog()
    cat.task_class.tenant_account_defaults = {"period": "DAY", "inputLimit": 1000, "concurrencyLimit": 1000}
    cat.task_class.save()
    results = run_concurrently(THREADS, lambda i: admit(spec(cat, input_tokens=100, output_tokens=1)))
    admitted, quota, other = _outcomes(results)
    assert other == []
    accounts = CapacityAccount.objects.filter(
        scope=Scope.TENANT_TASK, tenant=cat.tenant, task_class=cat.task_class
    )
    assert accounts.count() == 1
    assert (admitted, quota) == (10, THREADS - 10)
    assert accounts.get().input_reserved == 1000
    assert audit().ok


def test_concurrency_limit_is_exact():
    cat = catalog()
    account = tenant_account(cat, concurrency_limit=7)
    results = run_concurrently(THREADS, lambda i: admit(spec(cat)))
    admitted, _, other = _outcomes(results)
    assert other == []
    assert admitted == 7
    account.refresh_from_db()
    assert account.in_flight == 7


def _naive_reserve(account_id: int, n: int) -> bool:
    """Negative control: read, decide in Python, then write — the classic lost-update race."""
    import time

    with transaction.atomic():
        account = CapacityAccount.objects.get(pk=account_id)
        if account.input_reserved + n > (account.input_limit or 0):
            return False
        time.sleep(0.01)  # the window every real server has between its read and its write
        CapacityAccount.objects.filter(pk=account_id).update(input_reserved=account.input_reserved + n)
        LedgerEntry.objects.create(
            account=account, kind="HOLD", input_reserved=n, period_start=account.period_start
        )
        return True


def test_negative_control_naive_read_then_write_is_caught():
    cat = catalog()
    account = tenant_account(cat, input_limit=1000)
    results = run_concurrently(THREADS, lambda i: _naive_reserve(account.pk, 100))
    account.refresh_from_db()
    successes = sum(1 for r in results if r is True)
    # The same checks as above would fail: more than K=10 "admitted", and balances disagree with entries.
    assert successes > 10
    assert not audit().ok
    connection.close()


def test_a_replayed_key_answers_without_waiting_for_the_hot_accounts():
    """The reserving statement writes the reservation before it locks any account: a retry of a key already
    admitted fails on the unique index at once, while another transaction holds the account (a slow
    admission, a roll-over), instead of queueing behind it for nothing."""
    cat = catalog()
    account = tenant_account(cat)
    first = admit(spec(cat, key="retry-me"))
    with second_connection() as other:
        other.execute("SELECT 1 FROM ledger_capacityaccount WHERE id = %s FOR UPDATE", [account.pk])
        with connection.cursor() as cursor:
            cursor.execute("SET lock_timeout = '2s'")
        try:
            again = admit(spec(cat, key="retry-me"))
        finally:
            with connection.cursor() as cursor:
                cursor.execute("RESET lock_timeout")
        other.rollback()
    assert again.replayed and again.reservation.pk == first.reservation.pk
