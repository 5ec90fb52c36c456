"""The roles again (frozen as ``_roles.ROLES_0019``): the analyst may now view the catalog objects and billing imports its pages
link to, and finance the tokenizers a model revision links to (issue 19: no link into a 403)."""

from __future__ import annotations

from typing import Any

from django.db import migrations

from budgeting.migrations import _roles


def sync_roles(apps: Any, schema_editor: Any) -> None:
    _roles.sync(apps, _roles.ROLES_0019)


class Migration(migrations.Migration):
    dependencies = [
        ("budgeting", "0018_model_revision_counter"),
        ("reconciliation", "0001_initial"),
    ]

    operations = [migrations.RunPython(sync_roles, migrations.RunPython.noop)]
