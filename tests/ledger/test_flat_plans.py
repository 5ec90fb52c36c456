"""A settlement reads the reservation's own entries, never its accounts' history: the pages its statement
touches do not grow with the entries an account holds, whatever the planner knows of the table.

The statement is prepared, and a prepared statement is soon run on its generic plan; on a table without
statistics (autovacuum off, or not yet run) that plan once also scanned the account's index of the ledger,
reading every entry of the account. The pages are PostgreSQL's own count (``pg_statio_user_indexes`` and
``_tables``, the backend's statistics flushed after each call), so a loaded machine does not blur them.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection

from ledger.models import CapacityAccount, Reservation
from ledger.services import lifecycle
from tests.ledger.helpers import admit, catalog, fail_unsent, now, pool_account, spec, tenant_account

pytestmark = pytest.mark.django_db(transaction=True)

ACCOUNT_INDEX = "ledger_ledg_account_437ff1_idx"
HISTORY = 100_000

PAGES = """
SELECT (SELECT coalesce(sum(idx_blks_hit + idx_blks_read), 0) FROM pg_statio_user_indexes
         WHERE indexrelname = %s),
       (SELECT coalesce(sum(heap_blks_hit + heap_blks_read + idx_blks_hit + idx_blks_read), 0)
          FROM pg_statio_user_tables)
"""


def pages() -> tuple[int, int]:
    """The pages touched so far of the ledger's account index, and of every table and index."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_force_next_flush()")
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute(PAGES, [ACCOUNT_INDEX])
        index, everything = cursor.fetchone()
    return int(index), int(everything)


def dispatched(cat: Any) -> Reservation:
    r = admit(spec(cat, input_tokens=100, output_tokens=50)).reservation
    return lifecycle.dispatch(
        reservation_id=r.pk,
        tenant_ids=[cat.tenant.pk],
        fence=1,
        provider_request_id=f"p-{r.pk}",
        admitted_digest=r.admitted_digest,
        now=now(),
    )


def failed_pages(cat: Any) -> tuple[int, int]:
    """The pages one ``fail`` (never processed: a full release and refund) touched."""
    fail = fail_unsent(dispatched(cat), cat)
    before = pages()
    fail()
    after = pages()
    return after[0] - before[0], after[1] - before[1]


def add_history(account: CapacityAccount, entries: int) -> None:
    """``entries`` settled entries of other calls on ``account``, in its current period; no ANALYZE."""
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO ledger_ledgerentry (account_id, reservation_id, kind, input_reserved,"
            " output_reserved, input_consumed, output_consumed, in_flight, spend_reserved, spend_consumed,"
            " period_start, reason, created_by, created_at)"
            " SELECT %s, NULL, 'CORRECTION', 0, 0, 1, 1, 0, 0, 0, %s, 'history', '', now()"
            " FROM generate_series(1, %s)",
            [account.pk, account.period_start, entries],
        )


def generic_plans() -> None:
    """Every statement this connection prepares on its generic plan from its first run, as after five runs;
    the statements prepared so far go with the connection, so they are planned again on the table as it is."""
    connection.close()
    with connection.cursor() as cursor:
        cursor.execute("SET plan_cache_mode = force_generic_plan")


@pytest.fixture
def new_connection_after():
    yield
    connection.close()  # its session setting and the plans made under it go with it


def test_a_failure_touches_as_many_pages_with_a_long_history_as_without(new_connection_after):
    cat = catalog()
    tenant = tenant_account(cat, input_limit=10**9, output_limit=10**9, concurrency_limit=10)
    pool_account(cat, input_limit=10**9, output_limit=10**9)
    generic_plans()
    failed_pages(cat)  # prepares the statements
    index_short, all_short = failed_pages(cat)
    add_history(tenant, HISTORY)
    generic_plans()
    failed_pages(cat)
    index_long, all_long = failed_pages(cat)
    # The entries the failure inserts descend the account index (a few pages each); reading the account's
    # entries would be hundreds of pages more. The indexes the entries go into grow a level deeper.
    assert index_long - index_short <= 5, (index_short, index_long)
    assert all_long <= 1.2 * all_short, (all_short, all_long)


def test_the_count_sees_a_read_of_the_accounts_history(new_connection_after):
    """Negative control: a read of the account's entries by its index is counted, hundreds of pages. It is
    what the statement's old join chose on a table without statistics (393 pages of the account index on the
    development machine, where the first test fails on that statement); it is forced here, since whether a
    planner chooses it depends on the statistics it has (the embedded servers' autovacuum makes some)."""
    cat = catalog()
    tenant = tenant_account(cat, input_limit=10**9, output_limit=10**9, concurrency_limit=10)
    add_history(tenant, HISTORY)
    with connection.cursor() as cursor:
        cursor.execute("SET enable_seqscan = off")
    before = pages()
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT sum(input_consumed) FROM ledger_ledgerentry WHERE account_id = %s", [tenant.pk]
        )
        assert cursor.fetchone()[0] == HISTORY
    after = pages()
    assert after[0] - before[0] > 100, (before, after)
