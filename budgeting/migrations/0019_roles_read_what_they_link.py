"""The roles again (``sync_roles``): the analyst may now view the catalog objects and billing imports its pages
link to, and finance the tokenizers a model revision links to (issue 19: no link into a 403)."""

from __future__ import annotations

from typing import Any

from django.db import migrations


def sync_roles(apps: Any, schema_editor: Any) -> None:
    from budgeting.backoffice.roles import sync_roles_in_migration

    sync_roles_in_migration(apps)


class Migration(migrations.Migration):
    dependencies = [
        ("budgeting", "0018_model_revision_counter"),
        ("reconciliation", "0001_initial"),
    ]

    operations = [migrations.RunPython(sync_roles, migrations.RunPython.noop)]
