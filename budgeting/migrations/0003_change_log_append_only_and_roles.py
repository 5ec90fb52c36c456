"""The change log is append-only (a trigger, like the ledger's), and the finance/platform/analyst groups."""

from django.db import migrations

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
    # Permissions are normally created after all migrations (post_migrate); create them now so the groups
    # can be given them on a fresh database.
    from django.contrib.auth.management import create_permissions

    from budgeting.backoffice.roles import sync_roles

    for app_config in apps.get_app_configs():
        app_config.models_module = True
        create_permissions(app_config, apps=apps, verbosity=0)
        app_config.models_module = None
    sync_roles(apps)


def drop_roles(apps, schema_editor):
    from budgeting.backoffice.roles import ROLES

    apps.get_model("auth", "Group").objects.filter(name__in=list(ROLES)).delete()


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
