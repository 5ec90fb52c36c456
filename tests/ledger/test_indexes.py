"""Every index costs a write on every insert: an admission inserts a manifest, a reservation, its holds and
its ledger entries, and a settlement its usage event and entries. An index whose columns lead another index
of the same table serves no lookup the longer one does not, so none may be left on the tables the calls
write: the ledger's and the manifests. (The catalog's many-to-many tables keep Django's own pair: they
change by hand.)"""

from __future__ import annotations

import pytest
from django.db import connection

pytestmark = pytest.mark.django_db

# Each plain (non-unique, whole-table) index of those tables, with the columns of every whole-table
# index of its table (``indkey`` as text: the column numbers, space-separated); expression indexes (a 0 in
# indkey) are left out.
INDEXES = """
SELECT t.relname, i.relname, x.indkey::text, x.indisunique,
       array(SELECT y.indkey::text FROM pg_index y
             WHERE y.indrelid = x.indrelid AND y.indexrelid <> x.indexrelid AND y.indpred IS NULL
               AND NOT 0 = ANY (y.indkey::int2[]))
FROM pg_index x
JOIN pg_class i ON i.oid = x.indexrelid
JOIN pg_class t ON t.oid = x.indrelid
JOIN pg_namespace n ON n.oid = t.relnamespace
WHERE n.nspname = current_schema() AND (t.relname LIKE 'ledger\\_%' OR t.relname = 'budgeting_manifest')
  AND x.indpred IS NULL AND NOT 0 = ANY (x.indkey::int2[])
"""


def prefix_covered(columns: list[int], others: list[list[int]]) -> bool:
    return any(len(other) > len(columns) and other[: len(columns)] == columns for other in others)


def covered_indexes() -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute(INDEXES)
        rows = cursor.fetchall()
    return [
        f"{table}.{index}"
        for table, index, columns, unique, others in rows
        if not unique and prefix_covered(_columns(columns), [_columns(other) for other in others])
    ]


def _columns(indkey: str) -> list[int]:
    """The column numbers of an ``int2vector`` as text (``'2 5'``)."""
    return [int(part) for part in indkey.split()]


def test_no_index_is_led_by_another_index_of_its_table():
    assert covered_indexes() == []


def test_the_check_sees_a_covered_index():
    """Negative control: an index on the leading column of the hold's unique constraint is found."""
    with connection.cursor() as cursor:
        cursor.execute("CREATE INDEX probe_hold_reservation ON ledger_hold (reservation_id)")
    assert covered_indexes() == ["ledger_hold.probe_hold_reservation"]


def test_the_lookups_the_dropped_indexes_served_still_use_an_index():
    """Each lookup by a dropped index's column is an index scan of the longer index (sequential scans off, so
    the plan shows whether an index can serve it at all)."""
    some = "'01900000-0000-7000-8000-000000000000'"
    lookups = {
        f"SELECT * FROM ledger_hold WHERE reservation_id = {some}": "hold_unique",
        "SELECT * FROM ledger_ledgerentry WHERE account_id = 1": "ledger_ledg_account_437ff1_idx",
        f"SELECT * FROM ledger_usageevent WHERE reservation_id = {some}": "usage_event_unique_id",
        f"SELECT * FROM ledger_topup WHERE reservation_id = {some}": "top_up_unique_id",
        "SELECT * FROM ledger_reservation WHERE tenant_id = 1": "reservation_unique_idempotency_key",
        "SELECT * FROM ledger_reservation WHERE model_revision_id = 1": "ledger_rese_model_r_f81e77_idx",
        "SELECT * FROM budgeting_manifest WHERE tenant_id = 1": "budgeting_m_tenant__bcc1fa_idx",
    }
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
        for query, index in lookups.items():
            cursor.execute("EXPLAIN " + query)
            plan = "\n".join(row[0] for row in cursor.fetchall())
            assert index in plan, plan
