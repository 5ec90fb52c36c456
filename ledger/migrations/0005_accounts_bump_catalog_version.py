"""Which capacity accounts exist (and their scope and period) is part of the cached catalog snapshot: creating,
deleting or re-scoping one, and a period roll-over, bump the catalog version. Balance updates do not."""

from django.db import migrations

EVENTS = "INSERT OR DELETE OR UPDATE OF scope, tenant_id, task_class_id, pool_id, period, period_start"


class Migration(migrations.Migration):
    dependencies = [
        ("ledger", "0004_dispatched_index"),
        ("budgeting", "0010_catalog_version"),
    ]

    operations = [
        migrations.RunSQL(
            f"CREATE TRIGGER ledger_capacityaccount_bumps_catalog AFTER {EVENTS} ON ledger_capacityaccount "
            "FOR EACH STATEMENT EXECUTE FUNCTION budgeting_bump_catalog_version();",
            "DROP TRIGGER IF EXISTS ledger_capacityaccount_bumps_catalog ON ledger_capacityaccount;",
        ),
    ]
