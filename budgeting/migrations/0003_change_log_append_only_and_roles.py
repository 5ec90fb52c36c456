"""The change log is append-only (a trigger, like the ledger's), and the finance/platform/analyst groups."""

from django.db import migrations

from budgeting.migrations import _roles

APPEND_ONLY = """
CREATE OR REPLACE FUNCTION budgeting_changerecord_append_only() RETURNS trigger AS $$
BEGIN
    RAISE EXCEPTION 'the change log is append-only: % refused', TG_OP USING ERRCODE = 'check_violation';
END;
$$ LANGUAGE plpgsql;
CREATE TRIGGER budgeting_changerecord_append_only
    BEFORE UPDATE OR DELETE ON budgeting_changerecord
    FOR EACH ROW EXECUTE FUNCTION budgeting_changerecord_append_only();
"""

DROP = """
DROP TRIGGER IF EXISTS budgeting_changerecord_append_only ON budgeting_changerecord;
DROP FUNCTION IF EXISTS budgeting_changerecord_append_only();
"""


def create_roles(apps, schema_editor):
    _roles.sync(apps, _roles.ROLES_0013)


def drop_roles(apps, schema_editor):
    _roles.drop(apps, _roles.ROLES_0013)


class Migration(migrations.Migration):
    dependencies = [
        ("budgeting", "0002_people_side"),
        ("ledger", "0002_ledger_append_only"),
        ("auth", "0012_alter_user_first_name_max_length"),
        ("contenttypes", "0002_remove_content_type_name"),
    ]

    operations = [
        migrations.RunSQL(APPEND_ONLY, DROP),
        migrations.RunPython(create_roles, drop_roles),
    ]
