from django.db import migrations

APPEND_ONLY = """
CREATE OR REPLACE FUNCTION ledger_entry_append_only() RETURNS trigger AS $$
BEGIN
    RAISE EXCEPTION 'ledger entries are append-only: % refused', TG_OP USING ERRCODE = 'check_violation';
END;
$$ LANGUAGE plpgsql;
CREATE TRIGGER ledger_entry_append_only
    BEFORE UPDATE OR DELETE ON ledger_ledgerentry
    FOR EACH ROW EXECUTE FUNCTION ledger_entry_append_only();
"""

DROP = """
DROP TRIGGER IF EXISTS ledger_entry_append_only ON ledger_ledgerentry;
DROP FUNCTION IF EXISTS ledger_entry_append_only();
"""


class Migration(migrations.Migration):
    dependencies = [("ledger", "0001_initial")]

    operations = [migrations.RunSQL(APPEND_ONLY, DROP)]
