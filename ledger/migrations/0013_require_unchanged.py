"""``ledger_require_unchanged``: the last step of a lifecycle call's one write when the reservation was read
without a lock. The write's UPDATE of the reservation is conditional on the row version it was read at; when
another transaction changed the row since, the UPDATE matches nothing and the function raises (SQLSTATE
``TB409``), undoing the whole statement — its moves, entries and new rows — and the call is run again under
the row's lock."""

from django.db import migrations

REQUIRE_UNCHANGED = """
CREATE OR REPLACE FUNCTION ledger_require_unchanged(written boolean) RETURNS boolean AS $$
BEGIN
    IF NOT written THEN
        RAISE EXCEPTION 'the reservation changed since it was read' USING ERRCODE = 'TB409';
    END IF;
    RETURN written;
END;
$$ LANGUAGE plpgsql;
"""

DROP = "DROP FUNCTION IF EXISTS ledger_require_unchanged(boolean);"


class Migration(migrations.Migration):
    dependencies = [("ledger", "0012_spend")]

    operations = [migrations.RunSQL(REQUIRE_UNCHANGED, DROP)]
