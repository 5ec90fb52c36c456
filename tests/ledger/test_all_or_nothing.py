"""A new reservation holds on every account it needs, or on none.

The reserving statement is a transaction of its own (no BEGIN, no COMMIT): the hold an account refuses must
undo, inside the statement, the holds already taken on the accounts locked before it, the reservation and its
record. ``ledger_require_holds`` (migration ledger 0009) does that; the negative control shows what the same
statement commits without it.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator

import pytest
from django.db import connection, transaction

from budgeting.admission.models import Manifest
from budgeting.db.rows import RecordInsert
from ledger.errors import QuotaExceeded
from ledger.models import CapacityAccount, Hold, LedgerEntry, Reservation
from ledger.selectors import audit
from ledger.services import admission as ledger_admission
from tests.dbwork import count_db_work
from tests.ledger.helpers import admit, body, catalog, now, pool_account, spec, tenant_account

REQUIRE_HOLDS = importlib.import_module("ledger.migrations.0009_require_holds").REQUIRE_HOLDS


def balances(*accounts: CapacityAccount) -> list[tuple[int, int, int]]:
    for account in accounts:
        account.refresh_from_db()
    return [(a.input_reserved, a.output_reserved, a.in_flight) for a in accounts]


def two_accounts_refusing_last():
    """A pool account without limits locked first, then a tenant account with room for one admission."""
    cat = catalog()
    pool = pool_account(cat)
    tenant = tenant_account(cat, input_limit=150)
    assert pool.pk < tenant.pk  # the refusing account is locked after the one that takes the hold
    return cat, pool, tenant


@pytest.mark.django_db(transaction=True)
def test_a_refused_hold_leaves_no_trace_on_the_accounts_locked_before_it():
    cat, pool, tenant = two_accounts_refusing_last()
    admit(spec(cat, input_tokens=100, output_tokens=10))
    before = balances(pool, tenant)
    counts = (Reservation.objects.count(), Hold.objects.count(), LedgerEntry.objects.count())
    with count_db_work() as work, pytest.raises(QuotaExceeded) as refused:
        admit(spec(cat, input_tokens=100, output_tokens=10))
    assert refused.value.extra["account"]["id"] == tenant.pk
    assert balances(pool, tenant) == before
    assert (Reservation.objects.count(), Hold.objects.count(), LedgerEntry.objects.count()) == counts
    # The refused statement ran in autocommit mode: no transaction of its own was opened or committed.
    assert work.explicit_commits == 0 and work.rollbacks == 0, work.summary()
    assert audit().ok


@pytest.mark.django_db(transaction=True)
def test_the_record_inserted_by_a_refused_statement_is_undone_with_it():
    cat, _, _ = two_accounts_refusing_last()
    admit(spec(cat, input_tokens=100, output_tokens=10))
    manifests = Manifest.objects.count()
    record = Manifest(
        request_id="refused",
        tenant=cat.tenant,
        task_class=cat.task_class,
        model_pool=cat.pool,
        model_revision=cat.model,
        decision="ADMITTED",
        answer="RESERVED",
        rung="FULL",
        mode="ENFORCE",
        input_tokens=100,
        request={"requestId": "refused"},
        record={},
    )
    with pytest.raises(QuotaExceeded):
        ledger_admission.reserve(
            spec=spec(cat, input_tokens=100, output_tokens=10),
            build_body=body,
            now=now(),
            record=lambda state: RecordInsert.of(record),
        )
    assert Manifest.objects.count() == manifests


@pytest.mark.django_db
def test_inside_a_test_transaction_a_savepoint_bounds_the_refused_statement():
    cat, pool, tenant = two_accounts_refusing_last()
    assert connection.in_atomic_block
    admit(spec(cat, input_tokens=100, output_tokens=10))
    before = balances(pool, tenant)
    with pytest.raises(QuotaExceeded):
        admit(spec(cat, input_tokens=100, output_tokens=10))
    # The enclosing transaction is still usable, and holds only the first admission.
    assert balances(pool, tenant) == before
    assert Reservation.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_a_caller_transaction_is_refused_as_by_a_durable_atomic_block():
    cat, _, _ = two_accounts_refusing_last()
    with pytest.raises(RuntimeError), transaction.atomic():
        admit(spec(cat, input_tokens=100, output_tokens=10))
    assert Reservation.objects.count() == 0


@pytest.fixture
def holds_not_required() -> Iterator[None]:
    """The negative control: ``ledger_require_holds`` replaced by a function that only passes ``held`` on."""
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE OR REPLACE FUNCTION ledger_require_holds(wanted bigint[], held bigint[]) RETURNS bigint[]"
            " AS $$ SELECT held $$ LANGUAGE sql"
        )
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute(REQUIRE_HOLDS)


@pytest.mark.django_db(transaction=True)
def test_negative_control_without_the_check_the_statement_commits_a_partial_hold(holds_not_required):
    cat, pool, tenant = two_accounts_refusing_last()
    admit(spec(cat, input_tokens=100, output_tokens=10))
    pool_before, tenant_before = balances(pool, tenant)
    admit(spec(cat, input_tokens=100, output_tokens=10))  # no refusal reaches Python
    pool_after, tenant_after = balances(pool, tenant)
    assert tenant_after == tenant_before
    assert pool_after == (pool_before[0] + 100, pool_before[1] + 10, pool_before[2] + 1)
