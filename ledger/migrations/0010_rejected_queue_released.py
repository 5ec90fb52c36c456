"""A queued request rejected at its deadline now moves its output from ``remaining`` to ``released`` (it never
held any capacity); rows rejected before that kept ``remaining`` and read as leaks to the audit. This moves
theirs the same way: no hold, entry or balance changes (a queued request has none)."""

from django.db import migrations

RELEASE = """
UPDATE ledger_reservation SET released = released + remaining, remaining = 0
 WHERE state = 'REJECTED' AND remaining > 0
   AND NOT EXISTS (SELECT FROM ledger_hold WHERE ledger_hold.reservation_id = ledger_reservation.id)
"""


class Migration(migrations.Migration):
    dependencies = [("ledger", "0009_require_holds")]

    operations = [migrations.RunSQL(RELEASE, migrations.RunSQL.noop)]
