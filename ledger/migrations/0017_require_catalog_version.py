"""``ledger_require_catalog_version``: the reserving statement's check, for an admission authenticated from the
process's catalog snapshot without reading the catalog version first (``Caller.checked_version``). When the
version is not the one the snapshot was built from — a token revoked, any catalog change — it raises
(SQLSTATE ``TB412``) and the whole statement, a transaction of its own, is undone: nothing is written, and the
admission is made again after the catalog read."""

from django.db import migrations

REQUIRE_VERSION = """
CREATE OR REPLACE FUNCTION ledger_require_catalog_version(expected bigint) RETURNS void AS $$
BEGIN
    IF (SELECT version FROM budgeting_catalogversion WHERE id = 1) IS DISTINCT FROM expected THEN
        RAISE EXCEPTION 'the catalog version is not %', expected USING ERRCODE = 'TB412';
    END IF;
END;
$$ LANGUAGE plpgsql;
"""

DROP = "DROP FUNCTION IF EXISTS ledger_require_catalog_version(bigint);"


class Migration(migrations.Migration):
    dependencies = [("ledger", "0016_slot_free_label"), ("budgeting", "0010_catalog_version")]

    operations = [migrations.RunSQL(REQUIRE_VERSION, DROP)]
