"""The permission matrix: every role × every admin page and action is either allowed (200, or a redirect
after a successful POST) or refused (403), and refused actions change nothing. Buttons a role may not use
are not shown to it.

Roles: finance, platform, analyst (the groups of the data migration), a staff user with no role ("nobody"),
and a superuser ("root", allowed everywhere)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from django.urls import reverse
from django.utils import timezone

from budgeting.catalog.models import (
    ApiToken,
    ChangeRecord,
    PolicyAlias,
    PolicyVersion,
    Price,
    ServiceClient,
    TemporaryIncrease,
    Tenant,
)
from ledger.models import CapacityAccount, Scope
from reconciliation.models import BillingImport, BucketDrift
from tests.admin.conftest import login
from tests.factories import issue_token

F, P, A = "finance", "platform", "analyst"
EVERY_ROLE = {F, P, A}
ROLES_UNDER_TEST = ("finance", "platform", "analyst", "nobody", "root")


@dataclass(frozen=True)
class Page:
    """One admin page (GET) or action (POST): who may use it, and the URL and body from the world."""

    name: str
    allowed: frozenset[str]
    url: Callable[[dict[str, Any]], str]
    data: Callable[[dict[str, Any]], dict[str, Any]] | None = None

    @property
    def method(self) -> str:
        return "POST" if self.data is not None else "GET"


def admin(name: str, *args: Any) -> str:
    return reverse(f"admin:{name}", args=args)


def page(name: str, allowed: set[str], url: Callable[[dict[str, Any]], str], data: Any = None) -> Page:
    return Page(name, frozenset(allowed), url, data)


GETS = [
    page("index", EVERY_ROLE, lambda w: admin("index")),
    page("accounts", EVERY_ROLE, lambda w: admin("ledger_capacityaccount_changelist")),
    page("account", EVERY_ROLE, lambda w: admin("ledger_capacityaccount_change", w["account"].pk)),
    page("account limits form", {F}, lambda w: admin("ledger_capacityaccount_limits", w["account"].pk)),
    page("account increase form", {F}, lambda w: admin("ledger_capacityaccount_increase", w["account"].pk)),
    page(
        "account correction form", {F}, lambda w: admin("ledger_capacityaccount_correction", w["account"].pk)
    ),
    page("ledger entries", {F, P}, lambda w: admin("ledger_ledgerentry_changelist")),
    page("reservations", EVERY_ROLE, lambda w: admin("ledger_reservation_changelist")),
    page("reservation", EVERY_ROLE, lambda w: admin("ledger_reservation_change", w["reservation"].pk)),
    page("reconciling backlog", EVERY_ROLE, lambda w: admin("ledger_reservation_backlog")),
    page("resolve form", {F}, lambda w: admin("ledger_reservation_resolve", w["reservation"].pk)),
    page("manifests", EVERY_ROLE, lambda w: admin("budgeting_manifest_changelist")),
    page("manifest", EVERY_ROLE, lambda w: admin("budgeting_manifest_change", w["manifest"].pk)),
    page("manifest replay", EVERY_ROLE, lambda w: admin("budgeting_manifest_replay", w["manifest"].pk)),
    page("usage report", EVERY_ROLE, lambda w: admin("budgeting_usagereport_changelist")),
    page("tenant spend", EVERY_ROLE, lambda w: admin("budgeting_usagereport_tenant", w["tenant"].slug)),
    page("reports API", EVERY_ROLE, lambda w: "/api/v1/reports?format=json"),
    page("reports API csv", EVERY_ROLE, lambda w: "/api/v1/reports?format=csv"),
    page("change log", {F, P}, lambda w: admin("budgeting_changerecord_changelist")),
    page("temporary increases", {F, A}, lambda w: admin("budgeting_temporaryincrease_changelist")),
    page("alert thresholds", EVERY_ROLE, lambda w: admin("budgeting_alertthresholds_changelist")),
    page("alert thresholds add form", {F}, lambda w: admin("budgeting_alertthresholds_add")),
    page("threshold crossings", EVERY_ROLE, lambda w: admin("budgeting_thresholdcrossing_changelist")),
    page("login lockouts", {P}, lambda w: admin("axes_accessattempt_changelist")),
    page("login log", {P}, lambda w: admin("axes_accesslog_changelist")),
    page("access failures", {P}, lambda w: admin("axes_accessfailurelog_changelist")),
    page("prices", {F}, lambda w: admin("budgeting_price_changelist")),
    page("price add form", {F}, lambda w: admin("budgeting_price_add")),
    page("tenants", EVERY_ROLE, lambda w: admin("budgeting_tenant_changelist")),
    page("tenant", EVERY_ROLE, lambda w: admin("budgeting_tenant_change", w["tenant"].pk)),
    page("tenant add form", {P}, lambda w: admin("budgeting_tenant_add")),
    page("task classes", EVERY_ROLE, lambda w: admin("budgeting_taskclass_changelist")),
    page("task class add form", {P}, lambda w: admin("budgeting_taskclass_add")),
    page("model pools", EVERY_ROLE, lambda w: admin("budgeting_modelpool_changelist")),
    page("model revisions", EVERY_ROLE, lambda w: admin("budgeting_modelrevision_changelist")),
    page("model revision add form", {P}, lambda w: admin("budgeting_modelrevision_add")),
    page("tokenizers", EVERY_ROLE, lambda w: admin("budgeting_tokenizer_changelist")),
    page("tokenizer add form", {P}, lambda w: admin("budgeting_tokenizer_add")),
    page("service clients", {P}, lambda w: admin("budgeting_serviceclient_changelist")),
    page("service client", {P}, lambda w: admin("budgeting_serviceclient_change", w["client"].pk)),
    page("token rotation form", {P}, lambda w: admin("budgeting_serviceclient_rotate", w["client"].pk)),
    page(
        "token revocation form",
        {P},
        lambda w: admin("budgeting_serviceclient_revoke_token", w["client"].pk, w["token"].pk),
    ),
    page("policy versions", {P}, lambda w: admin("budgeting_policyversion_changelist")),
    page("policy draft", {P}, lambda w: admin("budgeting_policyversion_change", w["r20"].pk)),
    page("policy add form", {P}, lambda w: admin("budgeting_policyversion_add")),
    page("policy diff", {P}, lambda w: admin("budgeting_policyversion_diff") + "?a=18&b=19"),
    page("policy validate form", {P}, lambda w: admin("budgeting_policyversion_validate", w["r20"].pk)),
    page("policy activate form", {P}, lambda w: admin("budgeting_policyversion_activate", w["r18"].pk)),
    page("policy aliases", {P}, lambda w: admin("budgeting_policyalias_changelist")),
    page("policy rollback form", {P}, lambda w: admin("budgeting_policyalias_rollback", w["alias"].pk)),
    page("billing imports", EVERY_ROLE, lambda w: admin("reconciliation_billingimport_changelist")),
    page(
        "billing import", EVERY_ROLE, lambda w: admin("reconciliation_billingimport_change", w["import"].pk)
    ),
    page("billing import upload form", {F}, lambda w: admin("reconciliation_billingimport_upload")),
    page(
        "billing import remove form",
        {F},
        lambda w: admin("reconciliation_billingimport_remove", w["import"].pk),
    ),
    page("billing findings", EVERY_ROLE, lambda w: admin("reconciliation_billingfinding_changelist")),
    page("bucket drifts", EVERY_ROLE, lambda w: admin("reconciliation_bucketdrift_changelist")),
    page("billed requests", EVERY_ROLE, lambda w: admin("reconciliation_billedrequest_changelist")),
]

REASON = {"reason": "matrix test"}

# Actions that change state, in an order that keeps each one possible for the allowed role.
POSTS = [
    page(
        "set limits",
        {F},
        lambda w: admin("ledger_capacityaccount_limits", w["account"].pk),
        lambda w: {
            **REASON,
            "step": "confirm",
            "input_limit": 2_000_000,
            "output_limit": 100_000,
            "concurrency_limit": 10,
            "expected_input": 1_000_000,
            "expected_output": 100_000,
            "expected_concurrency": 10,
        },
    ),
    page(
        "grant temporary increase",
        {F},
        lambda w: admin("ledger_capacityaccount_increase", w["account"].pk),
        lambda w: {
            **REASON,
            "step": "confirm",
            "input_tokens": 1000,
            "output_tokens": 0,
            "concurrency": 0,
            "expires_at": (timezone.now() + timedelta(days=2)).strftime("%Y-%m-%dT%H:%M"),
        },
    ),
    page(
        "post correction",
        {F},
        lambda w: admin("ledger_capacityaccount_correction", w["account"].pk),
        lambda w: {**REASON, "step": "confirm", "input_consumed": -10, "output_consumed": 0},
    ),
    page(
        "add price",
        {F},
        lambda w: admin("budgeting_price_add"),
        lambda w: {
            "model_revision": w["scenario"].model.pk,
            "effective_from_0": (timezone.now() + timedelta(days=1)).date().isoformat(),
            "effective_from_1": "00:00:00",
            "currency": "EUR",
            "input_per_million": "1.5",
            "output_per_million": "6",
            "change_reason": "matrix test",
        },
    ),
    page(
        "edit tenant",
        {P},
        lambda w: admin("budgeting_tenant_change", w["tenant"].pk),
        lambda w: {
            "slug": w["tenant"].slug,
            "name": "Renamed",
            "rollout_mode": "ENFORCE",
            "change_reason": "matrix test",
        },
    ),
    page(
        "rotate token",
        {P},
        lambda w: admin("budgeting_serviceclient_rotate", w["client"].pk),
        lambda w: {**REASON, "revoke_current": "", "once": "matrix"},
    ),
    page(
        "validate draft",
        {P},
        lambda w: admin("budgeting_policyversion_validate", w["r20"].pk),
        lambda w: REASON,
    ),
    page(
        "activate version",
        {P},
        lambda w: admin("budgeting_policyversion_activate", w["r18"].pk),
        lambda w: {**REASON, "expected_version": w["r19"].pk},
    ),
    page(
        "roll back alias",
        {P},
        lambda w: admin("budgeting_policyalias_rollback", w["alias"].pk),
        lambda w: {**REASON, "expected_version": w["r18"].pk},
    ),
]


def state_fingerprint() -> tuple[Any, ...]:
    """Everything a refused action could have changed."""
    return (
        list(CapacityAccount.objects.order_by("pk").values_list("input_limit", "input_consumed")),
        TemporaryIncrease.objects.count(),
        Price.objects.count(),
        list(Tenant.objects.order_by("pk").values_list("name", flat=True)),
        ApiToken.objects.count(),
        list(PolicyVersion.objects.order_by("pk").values_list("state", flat=True)),
        list(PolicyAlias.objects.values_list("version_id", "previous_id")),
        ChangeRecord.objects.count(),
    )


@pytest.fixture
def world(users, scenario, policies) -> dict[str, Any]:
    alias = PolicyAlias.objects.get(name="production")
    # production at r19 with r18 as the rollback target, so both activation and rollback pages exist.
    PolicyAlias.objects.filter(pk=alias.pk).update(version=policies["r19"], previous=policies["r18"])
    client = ServiceClient.objects.create(name="gateway-matrix")
    client.tenants.set([scenario.tenant])
    issue_token(client, "tb_matrix_token_aaaaaaaaaaaaaaaa")
    billing_import = BillingImport.objects.create(source="export.csv", fmt="csv", content_sha256="0" * 64)
    BucketDrift.objects.create(
        billing_import=billing_import,
        model="m",
        bucket_start=timezone.now() - timedelta(hours=1),
        bucket_end=timezone.now(),
        billed_input=10,
        billed_output=5,
        captured_input=10,
        captured_output=4,
    )
    return {
        "scenario": scenario,
        "account": CapacityAccount.objects.get(scope=Scope.TENANT, tenant=scenario.tenant),
        "reservation": scenario.reservations["dedup"],
        "manifest": scenario.manifests["dedup"],
        "tenant": scenario.tenant,
        "client": ServiceClient.objects.get(pk=client.pk),
        "token": ApiToken.objects.get(client=client),
        "alias": alias,
        "import": billing_import,
        **policies,
    }


def _allowed(role: str, p: Page) -> bool:
    return role == "root" or role in p.allowed


@pytest.mark.parametrize("role", ROLES_UNDER_TEST)
def test_every_page_is_allowed_or_forbidden_as_the_matrix_says(role, world):
    client = login(role)
    wrong = []
    for p in GETS:
        status = client.get(p.url(world)).status_code
        expected = 200 if _allowed(role, p) else 403
        if p.name == "index":
            expected = 200  # every staff user has a home page; what it lists is checked below
        if status != expected:
            wrong.append(f"GET {p.name}: {status}, expected {expected}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("role", ROLES_UNDER_TEST)
def test_every_action_is_allowed_or_refused_without_effect(role, world):
    client = login(role)
    wrong = []
    for p in POSTS:
        assert p.data is not None
        before = state_fingerprint()
        response = client.post(p.url(world), p.data(world))
        after = state_fingerprint()
        if _allowed(role, p):
            if response.status_code not in (200, 302) or before == after:
                wrong.append(f"POST {p.name}: {response.status_code}, changed={before != after}")
        elif response.status_code != 403 or before != after:
            wrong.append(f"POST {p.name}: {response.status_code}, changed={before != after}, expected 403")
    assert not wrong, "\n".join(wrong)


def test_every_admin_page_and_action_is_in_the_matrix():
    """A new admin route must be added to the matrix: compare with the URLs the admin site serves."""
    from django.contrib import admin as django_admin

    custom = {
        p.name
        for model_admin in django_admin.site._registry.values()
        for p in model_admin.get_urls()
        if p.name and not p.name.endswith(("_changelist", "_add", "_change", "_delete", "_history"))
    }
    covered = {
        "ledger_capacityaccount_limits",
        "ledger_capacityaccount_increase",
        "ledger_capacityaccount_correction",
        "ledger_reservation_backlog",
        "ledger_reservation_resolve",
        "budgeting_usagereport_tenant",
        "budgeting_manifest_replay",
        "budgeting_serviceclient_rotate",
        "budgeting_serviceclient_revoke_token",
        "budgeting_policyversion_diff",
        "budgeting_policyversion_validate",
        "budgeting_policyversion_activate",
        "budgeting_policyalias_rollback",
        "reconciliation_billingimport_upload",
        "reconciliation_billingimport_remove",
        "budgeting_policyversion_schema",  # public: the published policy JSON Schema
    }
    assert custom == covered


INDEX_LINKS = {
    "Capacity accounts": EVERY_ROLE,
    "Tokenizers": EVERY_ROLE,
    "Policy versions": {P},
    "Prices": {F},
    "Temporary increases": {F, A},
    "Alert thresholds": EVERY_ROLE,
    "Access attempts": {P},
    "Usage report": EVERY_ROLE,
    "Reservations": EVERY_ROLE,
    "Billing imports": EVERY_ROLE,
    "Change log": {F, P},
}


@pytest.mark.parametrize("role", ["finance", "platform", "analyst", "nobody"])
def test_the_home_page_lists_only_what_the_role_may_open(role, world):
    html = login(role).get(admin("index")).content.decode()
    shown = {name for name in INDEX_LINKS if f">{name}<" in html}
    assert shown == {name for name, roles in INDEX_LINKS.items() if role in roles}


@pytest.mark.parametrize(
    ("role", "visible", "hidden"),
    [
        (F, ["Edit limits", "Grant a temporary increase", "Post a correction"], []),
        (P, [], ["Edit limits", "Grant a temporary increase", "Post a correction"]),
        (A, [], ["Edit limits", "Grant a temporary increase", "Post a correction"]),
    ],
)
def test_account_buttons_follow_the_role(role, visible, hidden, world):
    html = login(role).get(admin("ledger_capacityaccount_change", world["account"].pk)).content.decode()
    for label in visible:
        assert label in html
    for label in hidden:
        assert label not in html


def test_nobody_can_edit_or_delete_ledger_rows_or_change_records(world):
    root = login("root")
    entry = world["reservation"].entries.first()
    assert root.get(admin("ledger_ledgerentry_change", entry.pk)).status_code == 200
    assert root.post(admin("ledger_ledgerentry_delete", entry.pk), {"post": "yes"}).status_code == 403
    assert root.get(admin("ledger_ledgerentry_add")).status_code == 403
    assert root.get(admin("ledger_reservation_add")).status_code == 403
    record = ChangeRecord.objects.create(
        actor_username="x", action="a", target_type="t.t", target_id="1", target_repr="r", reason="r"
    )
    assert root.post(admin("budgeting_changerecord_delete", record.pk), {"post": "yes"}).status_code == 403
