"""The three admin roles as Django groups, and what each may do.

Permissions are Django's own model permissions, read with their admin meaning:

- ``ledger.change_capacityaccount`` edits an account's limits (through a confirmation page);
- ``ledger.add_ledgerentry`` posts a compensating correction (ledger rows are never edited or deleted);
- ``budgeting.change_policyalias`` activates and rolls back policy versions (alias compare-and-swap);
- ``budgeting.add_apitoken`` rotates a service client's token;
- ``budgeting.view_usagereport`` opens the reports page and the reports API;
- ``reconciliation.add_billingimport`` uploads a provider's billing export.

``sync_roles`` makes the groups hold exactly these permissions. It runs from a data migration and is safe to
run again: migration 0004 re-runs it once the billing-import models exist, and a migration that adds models
whose permissions a role needs should do the same.
"""

from __future__ import annotations

from typing import Any

from django.apps import apps as global_apps

FINANCE = "finance"
PLATFORM = "platform"
ANALYST = "analyst"

_CATALOG = ("tenant", "taskclass", "modelpool", "modelrevision", "tokenizer", "serviceclient")

ROLES: dict[str, tuple[str, ...]] = {
    FINANCE: (
        "ledger.view_capacityaccount",
        "ledger.change_capacityaccount",
        "ledger.view_reservation",
        "ledger.view_ledgerentry",
        "ledger.add_ledgerentry",
        "budgeting.view_temporaryincrease",
        "budgeting.add_temporaryincrease",
        "budgeting.change_temporaryincrease",
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
    PLATFORM: (
        *(f"budgeting.{verb}_{model}" for model in _CATALOG for verb in ("view", "add", "change")),
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
    ),
    ANALYST: (
        "ledger.view_reservation",
        "budgeting.view_manifest",
        "budgeting.view_usagereport",
    ),
}

REPORT_PERMISSION = "budgeting.view_usagereport"


def sync_roles(apps: Any = global_apps) -> dict[str, list[str]]:
    """Create the groups and give each exactly its permissions; returns the permissions not found per role.

    Permissions of models that do not exist yet (billing imports before their migration) are skipped and
    reported, so running this again after they appear completes the roles.
    """
    group_model = apps.get_model("auth", "Group")
    permission_model = apps.get_model("auth", "Permission")
    missing: dict[str, list[str]] = {}
    for name, wanted in ROLES.items():
        group, _ = group_model.objects.get_or_create(name=name)
        found = []
        for dotted in wanted:
            app_label, codename = dotted.split(".", 1)
            permission = permission_model.objects.filter(
                content_type__app_label=app_label, codename=codename
            ).first()
            if permission is None:
                missing.setdefault(name, []).append(dotted)
            else:
                found.append(permission)
        group.permissions.set(found)
    return missing
