"""Give the roles the billing-import permissions (their models arrived in reconciliation 0001)."""

from django.db import migrations


def sync(apps, schema_editor):
    from django.contrib.auth.management import create_permissions

    from budgeting.backoffice.roles import sync_roles

    for app_config in apps.get_app_configs():
        app_config.models_module = True
        create_permissions(app_config, apps=apps, verbosity=0)
        app_config.models_module = None
    sync_roles(apps)


class Migration(migrations.Migration):
    dependencies = [
        ("budgeting", "0003_change_log_append_only_and_roles"),
        ("reconciliation", "0001_initial"),
    ]

    operations = [migrations.RunPython(sync, migrations.RunPython.noop)]
