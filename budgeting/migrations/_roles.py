"""The admin roles as the migrations set them, frozen: a migration must not import the live
``budgeting/backoffice/roles.py``, whose lists change after the migration was written (replaying an old
migration would then give a role permissions it did not have at that point, or fail on a model not yet
there). A migration that changes a role's permissions freezes its own lists here and calls ``sync``;
``tests/admin/test_frozen_roles.py`` checks that the last frozen lists are the live ones.

Not a migration itself: Django's loader skips modules whose name starts with an underscore.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# The roles as of migration 0013 (and, before it, 0003 and 0004: permissions of models not created yet are
# skipped, and 0013 sets them all).
ROLES_0013: dict[str, tuple[str, ...]] = {
    "finance": (
        "ledger.view_capacityaccount",
        "ledger.change_capacityaccount",
        "ledger.view_reservation",
        "ledger.view_ledgerentry",
        "ledger.add_ledgerentry",
        "budgeting.view_temporaryincrease",
        "budgeting.add_temporaryincrease",
        "budgeting.change_temporaryincrease",
        "budgeting.view_alertthresholds",
        "budgeting.add_alertthresholds",
        "budgeting.change_alertthresholds",
        "budgeting.view_thresholdcrossing",
        "budgeting.view_price",
        "budgeting.add_price",
        "budgeting.change_price",
        "budgeting.view_manifest",
        "budgeting.view_usagereport",
        "budgeting.view_changerecord",
        "budgeting.view_tenant",
        "budgeting.view_taskclass",
        "budgeting.view_modelpool",
        "budgeting.view_modelrevision",
        "reconciliation.view_billingimport",
        "reconciliation.add_billingimport",
        "reconciliation.view_billingfinding",
        "reconciliation.view_bucketdrift",
        "reconciliation.view_billedrequest",
    ),
    "platform": (
        "budgeting.view_tenant",
        "budgeting.add_tenant",
        "budgeting.change_tenant",
        "budgeting.view_taskclass",
        "budgeting.add_taskclass",
        "budgeting.change_taskclass",
        "budgeting.view_modelpool",
        "budgeting.add_modelpool",
        "budgeting.change_modelpool",
        "budgeting.view_modelrevision",
        "budgeting.add_modelrevision",
        "budgeting.change_modelrevision",
        "budgeting.view_tokenizer",
        "budgeting.add_tokenizer",
        "budgeting.change_tokenizer",
        "budgeting.view_serviceclient",
        "budgeting.add_serviceclient",
        "budgeting.change_serviceclient",
        "budgeting.view_apitoken",
        "budgeting.add_apitoken",
        "budgeting.change_apitoken",
        "budgeting.view_policyversion",
        "budgeting.add_policyversion",
        "budgeting.change_policyversion",
        "budgeting.view_policyalias",
        "budgeting.change_policyalias",
        "budgeting.view_manifest",
        "budgeting.view_usagereport",
        "budgeting.view_changerecord",
        "ledger.view_capacityaccount",
        "ledger.view_reservation",
        "ledger.view_ledgerentry",
        "reconciliation.view_billingimport",
        "reconciliation.view_billingfinding",
        "reconciliation.view_bucketdrift",
        "reconciliation.view_billedrequest",
        "budgeting.view_alertthresholds",
        "budgeting.view_thresholdcrossing",
        "axes.view_accessattempt",
        "axes.delete_accessattempt",
        "axes.view_accesslog",
        "axes.view_accessfailurelog",
    ),
    "analyst": (
        "ledger.view_capacityaccount",
        "ledger.view_reservation",
        "budgeting.view_temporaryincrease",
        "budgeting.view_alertthresholds",
        "budgeting.view_thresholdcrossing",
        "budgeting.view_manifest",
        "budgeting.view_usagereport",
    ),
}


# The roles as of migration 0019: the analyst views the catalog objects and billing imports its pages link to,
# finance the tokenizers a model revision links to.
ROLES_0019: dict[str, tuple[str, ...]] = {
    "finance": (
        "ledger.view_capacityaccount",
        "ledger.change_capacityaccount",
        "ledger.view_reservation",
        "ledger.view_ledgerentry",
        "ledger.add_ledgerentry",
        "budgeting.view_temporaryincrease",
        "budgeting.add_temporaryincrease",
        "budgeting.change_temporaryincrease",
        "budgeting.view_alertthresholds",
        "budgeting.add_alertthresholds",
        "budgeting.change_alertthresholds",
        "budgeting.view_thresholdcrossing",
        "budgeting.view_price",
        "budgeting.add_price",
        "budgeting.change_price",
        "budgeting.view_manifest",
        "budgeting.view_usagereport",
        "budgeting.view_changerecord",
        "budgeting.view_tenant",
        "budgeting.view_taskclass",
        "budgeting.view_modelpool",
        "budgeting.view_modelrevision",
        "budgeting.view_tokenizer",
        "reconciliation.view_billingimport",
        "reconciliation.add_billingimport",
        "reconciliation.view_billingfinding",
        "reconciliation.view_bucketdrift",
        "reconciliation.view_billedrequest",
    ),
    "platform": (
        "budgeting.view_tenant",
        "budgeting.add_tenant",
        "budgeting.change_tenant",
        "budgeting.view_taskclass",
        "budgeting.add_taskclass",
        "budgeting.change_taskclass",
        "budgeting.view_modelpool",
        "budgeting.add_modelpool",
        "budgeting.change_modelpool",
        "budgeting.view_modelrevision",
        "budgeting.add_modelrevision",
        "budgeting.change_modelrevision",
        "budgeting.view_tokenizer",
        "budgeting.add_tokenizer",
        "budgeting.change_tokenizer",
        "budgeting.view_serviceclient",
        "budgeting.add_serviceclient",
        "budgeting.change_serviceclient",
        "budgeting.view_apitoken",
        "budgeting.add_apitoken",
        "budgeting.change_apitoken",
        "budgeting.view_policyversion",
        "budgeting.add_policyversion",
        "budgeting.change_policyversion",
        "budgeting.view_policyalias",
        "budgeting.change_policyalias",
        "budgeting.view_manifest",
        "budgeting.view_usagereport",
        "budgeting.view_changerecord",
        "ledger.view_capacityaccount",
        "ledger.view_reservation",
        "ledger.view_ledgerentry",
        "reconciliation.view_billingimport",
        "reconciliation.view_billingfinding",
        "reconciliation.view_bucketdrift",
        "reconciliation.view_billedrequest",
        "budgeting.view_alertthresholds",
        "budgeting.view_thresholdcrossing",
        "axes.view_accessattempt",
        "axes.delete_accessattempt",
        "axes.view_accesslog",
        "axes.view_accessfailurelog",
    ),
    "analyst": (
        "ledger.view_capacityaccount",
        "ledger.view_reservation",
        "budgeting.view_temporaryincrease",
        "budgeting.view_alertthresholds",
        "budgeting.view_thresholdcrossing",
        "budgeting.view_manifest",
        "budgeting.view_usagereport",
        "budgeting.view_tenant",
        "budgeting.view_taskclass",
        "budgeting.view_modelpool",
        "budgeting.view_modelrevision",
        "budgeting.view_tokenizer",
        "reconciliation.view_billingimport",
        "reconciliation.view_billingfinding",
        "reconciliation.view_bucketdrift",
        "reconciliation.view_billedrequest",
    ),
}


def sync(apps: Any, roles: Mapping[str, Sequence[str]]) -> None:
    """Create the groups and give each exactly these permissions (those of models that do not exist yet are
    skipped). The permissions of models created earlier in the same migrate run do not exist yet (Django makes
    them after the run), so they are made first."""
    from django.contrib.auth.management import create_permissions

    for app_config in apps.get_app_configs():
        app_config.models_module = True
        create_permissions(app_config, apps=apps, verbosity=0)
        app_config.models_module = None
    group_model = apps.get_model("auth", "Group")
    permission_model = apps.get_model("auth", "Permission")
    for name, wanted in roles.items():
        group, _ = group_model.objects.get_or_create(name=name)
        found = []
        for dotted in wanted:
            app_label, codename = dotted.split(".", 1)
            permission = permission_model.objects.filter(
                content_type__app_label=app_label, codename=codename
            ).first()
            if permission is not None:
                found.append(permission)
        group.permissions.set(found)


def drop(apps: Any, roles: Mapping[str, Sequence[str]]) -> None:
    """Delete the groups of these roles."""
    apps.get_model("auth", "Group").objects.filter(name__in=list(roles)).delete()
