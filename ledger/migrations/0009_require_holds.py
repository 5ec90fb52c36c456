"""``ledger_require_holds``: the reserving statement's last step. A new reservation holds on every account it
needs or on none: when an account refused the hold, the function raises (SQLSTATE ``TB429``, the refused
accounts in its detail) and the whole statement, a transaction of its own, is undone with the reservation,
its record and the other accounts' holds."""

from django.db import migrations

REQUIRE_HOLDS = """
CREATE OR REPLACE FUNCTION ledger_require_holds(wanted bigint[], held bigint[]) RETURNS bigint[] AS $$
DECLARE
    refused bigint[] := ARRAY(SELECT unnest(wanted) EXCEPT SELECT unnest(held) ORDER BY 1);
BEGIN
    IF cardinality(refused) > 0 THEN
        RAISE EXCEPTION 'capacity refused the hold on accounts %', refused
            USING ERRCODE = 'TB429', DETAIL = array_to_string(refused, ',');
    END IF;
    RETURN held;
END;
$$ LANGUAGE plpgsql;
"""

DROP = "DROP FUNCTION IF EXISTS ledger_require_holds(bigint[], bigint[]);"


class Migration(migrations.Migration):
    dependencies = [("ledger", "0008_packed_reservation_bodies")]

    operations = [migrations.RunSQL(REQUIRE_HOLDS, DROP)]
