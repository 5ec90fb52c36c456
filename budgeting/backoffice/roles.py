"""The three admin roles as Django groups, and what each may do.

Permissions are Django's own model permissions, read with their admin meaning:

- ``ledger.change_capacityaccount`` edits an account's limits (through a confirmation page);
- ``ledger.add_ledgerentry`` posts a compensating correction (ledger rows are never edited or deleted);
- ``budgeting.change_policyalias`` activates and rolls back policy versions (alias compare-and-swap);
- ``budgeting.add_apitoken`` rotates a service client's token;
- ``budgeting.view_usagereport`` opens the reports page and the reports API;
- ``reconciliation.add_billingimport`` uploads a provider's billing export;
- ``budgeting.change_alertthresholds`` sets an account's alert thresholds;
- ``axes.view_accessattempt`` shows admin login lockouts, ``axes.delete_accessattempt`` lifts one.

Finance manages limits and money, platform the catalog, policies, tokens and lockouts, and the analyst reads:
reports, and balances and limits without changing them. People get a role with ``manage.py grant_role``.

``sync_roles`` makes the groups hold exactly these permissions (``grant_role`` runs it first). Migrations
never import this module: each one that sets the roles freezes its lists in
``budgeting/migrations/_roles.py``, so a change here needs a migration with the new lists (a test compares
the last frozen lists with these).
"""

from __future__ import annotations

from typing import Any

from django.apps import apps as global_apps
from django.contrib.auth.models import Group, User
from django.db import transaction

from budgeting.catalog.changes import Actor, record_change

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
        "budgeting.view_alertthresholds",
        "budgeting.view_thresholdcrossing",
        "axes.view_accessattempt",
        "axes.delete_accessattempt",
        "axes.view_accesslog",
        "axes.view_accessfailurelog",
    ),
    # The analyst reads what the reports are about, so the pages it opens link only to pages it may open:
    # the catalog objects a report or an account names, and the billing imports a backlog links to.
    ANALYST: (
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


def roles_of(user: User) -> list[str]:
    return sorted(user.groups.filter(name__in=ROLES).values_list("name", flat=True))


def grant_role(user: User, role: str, *, actor: Actor, reason: str) -> bool:
    """Make ``user`` staff and give it ``role``, recorded in the change log; returns False when it already
    had the role (nothing changes). Raises ValueError for an unknown role."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; roles are {', '.join(ROLES)}")
    with transaction.atomic(durable=True):
        sync_roles()
        before = roles_of(user)
        if role in before and user.is_staff:
            return False
        user.groups.add(Group.objects.get(name=role))
        user.is_staff = True
        user.save(update_fields=["is_staff"])
        _record(user, "user.grant_role", before, actor, reason)
    return True


def revoke_role(user: User, role: str, *, actor: Actor, reason: str) -> bool:
    """Take ``role`` from ``user``, recorded in the change log; returns False when it did not have it. A
    user left with no role and no superuser status loses staff status too, so it cannot sign in to the
    admin. Raises ValueError for an unknown role."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; roles are {', '.join(ROLES)}")
    with transaction.atomic(durable=True):
        before = roles_of(user)
        if role not in before:
            return False
        user.groups.remove(Group.objects.get(name=role))
        if not roles_of(user) and not user.is_superuser:
            user.is_staff = False
            user.save(update_fields=["is_staff"])
        _record(user, "user.revoke_role", before, actor, reason)
    return True


def _record(user: User, action: str, before: list[str], actor: Actor, reason: str) -> None:
    record_change(
        actor=actor,
        action=action,
        target=user,
        before={"roles": before},
        after={"roles": roles_of(user), "staff": user.is_staff},
        reason=reason,
    )
