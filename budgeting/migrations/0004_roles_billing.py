"""Give the roles the billing-import permissions (their models arrived in reconciliation 0001)."""

from django.db import migrations

from budgeting.migrations import _roles


def sync(apps, schema_editor):
    _roles.sync(apps, _roles.ROLES_0013)


class Migration(migrations.Migration):
    dependencies = [
        ("budgeting", "0003_change_log_append_only_and_roles"),
        ("reconciliation", "0001_initial"),
    ]

    operations = [migrations.RunPython(sync, migrations.RunPython.noop)]
