"""What the admin pages show, and the catalog edits, token rotation, billing import and increase revocation
that go through them (each recorded in the change log)."""

from __future__ import annotations

import hashlib
from datetime import timedelta
from decimal import Decimal
from pathlib import Path

import pytest
from django.conf import settings
from django.contrib import admin
from django.core.files.uploadedfile import SimpleUploadedFile
from django.db import models
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from budgeting.backoffice.kit import CONSTRAINT_WORDS, AuditedAdmin, constraint_fields
from budgeting.catalog.changes import Actor
from budgeting.catalog.models import (
    ApiToken,
    ChangeRecord,
    ModelRevision,
    Price,
    ServiceClient,
    TemporaryIncrease,
    Tenant,
    Tokenizer,
)
from ledger.models import CapacityAccount, Reservation, Scope, State
from ledger.services import limits, settlement
from reconciliation.models import BillingFinding, BillingImport, FindingKind
from tests.admin.conftest import login
from tests.factories import ServiceClientFactory, issue_token

pytestmark = pytest.mark.django_db


def page(client: Client, name: str, *args: object, query: str = "") -> str:
    response = client.get(reverse(f"admin:{name}", args=args) + query)
    assert response.status_code == 200
    return response.content.decode()


def test_reservation_page_shows_lifecycle_holds_entries_usage_lease_and_manifest(users, scenario):
    r = scenario.reservations["dedup"]
    html = page(login("analyst"), "ledger_reservation_change", r.pk)
    for text in (
        "Admitted (RESERVED)",
        "Dispatched",
        "Usage u1 (final)",
        "Settled (COMPLETED)",
        "on 2 accounts",  # one timeline line per operation, whatever the number of accounts
        "pool eu-large",  # a hold
        "fence 1",
        "DEDUP_EVIDENCE",
        "e3, e4",  # the ladder step's removed ids
        "2600",  # tokens before the step
    ):
        assert text in html, text
    assert html.index("Admitted (RESERVED)") < html.index("Dispatched") < html.index("Settled (COMPLETED)")
    assert 'name="state"' not in html  # read-only: no field to edit


def test_reservation_list_filters_by_state_and_rung(users, scenario):
    analyst = login("analyst")
    reconciling = page(analyst, "ledger_reservation_changelist", query="?state__exact=RECONCILING")
    assert "req-unknown" in reconciling and "req-full" not in reconciling
    trimmed = page(analyst, "ledger_reservation_changelist", query="?rung=TRIM_EVIDENCE")
    assert "req-overrun" in trimmed and "req-dedup" not in trimmed


def test_backlog_lists_reconciling_reservations_with_their_age(users, scenario):
    html = page(login("analyst"), "ledger_reservation_backlog")
    assert "req-unknown" in html and "40 min" in html
    assert "req-full" not in html
    assert "<svg" in html


def test_replay_shows_the_replay_result(users, scenario):
    from budgeting.admission.replay import replay_manifest

    analyst = login("analyst")
    manifest = scenario.manifests["dedup"]
    expected = replay_manifest(manifest.pk)
    html = page(analyst, "budgeting_manifest_replay", manifest.pk)
    assert ("matches the record" in html) == expected.matches
    assert ("MISMATCH" in html) == (not expected.matches)


def test_account_list_shows_balances_and_usage_bars_and_filters(users, scenario):
    finance = login("finance")
    html = page(finance, "ledger_capacityaccount_changelist")
    assert "tb-bar" in html and "tenant t-19" in html and "pool eu-large" in html
    pools_only = page(finance, "ledger_capacityaccount_changelist", query="?scope__exact=POOL")
    assert "pool eu-large" in pools_only and "tenant t-19" not in pools_only
    searched = page(finance, "ledger_capacityaccount_changelist", query="?q=eu-large")
    assert "pool eu-large" in searched and "tenant t-19<" not in searched


def test_catalog_edits_need_a_reason_and_are_logged_before_and_after(users, scenario):
    platform = login("platform")
    tenant = scenario.tenant
    url = reverse("admin:budgeting_tenant_change", args=[tenant.pk])
    body = {"slug": tenant.slug, "name": tenant.name, "internal": "on", "rollout_mode": "SHADOW"}
    refused = platform.post(url, body)
    assert refused.status_code == 200 and "This field is required" in refused.content.decode()
    assert Tenant.objects.get(pk=tenant.pk).rollout_mode == "ENFORCE"
    assert platform.post(url, {**body, "change_reason": "pause enforcement"}).status_code == 302
    record = ChangeRecord.objects.get(action="tenant.change")
    assert (record.before["rollout_mode"], record.after["rollout_mode"]) == ("ENFORCE", "SHADOW")
    assert (record.before["internal"], record.after["internal"]) == (False, True)
    assert record.actor_username == "platform"
    assert "pause enforcement" in page(platform, "budgeting_changerecord_changelist")


def test_many_to_many_edits_are_logged_as_ids(users, scenario):
    client = ServiceClientFactory(name="gw", tenants=[scenario.tenant])
    other = Tenant.objects.create(slug="t-77", name="Other")
    url = reverse("admin:budgeting_serviceclient_change", args=[client.pk])
    body = {
        "name": "gw",
        "is_active": "on",
        "tenants": [scenario.tenant.pk, other.pk],
        "change_reason": "onboard t-77",
        "tokens-TOTAL_FORMS": "0",
        "tokens-INITIAL_FORMS": "0",
    }
    assert login("platform").post(url, body).status_code == 302
    record = ChangeRecord.objects.get(action="serviceclient.change")
    assert record.before["tenants"] == [scenario.tenant.pk]
    assert record.after["tenants"] == sorted([scenario.tenant.pk, other.pk])


def test_ramp_percent_is_edited_on_the_task_class(users, scenario):
    platform = login("platform")
    task = scenario.task_class
    url = reverse("admin:budgeting_taskclass_change", args=[task.pk])
    body = {
        "slug": task.slug,
        "description": "",
        "input_cap": task.input_cap,
        "max_output_cap": task.max_output_cap,
        "queue_deadline_seconds": 60,
        "ramp_percent": 25,
        "tenant_account_defaults": "null",
        "change_reason": "ramp to a quarter",
    }
    assert platform.post(url, body).status_code == 302
    task.refresh_from_db()
    assert task.ramp_percent == 25
    assert ChangeRecord.objects.get(action="taskclass.change").after["ramp_percent"] == 25


def test_tokenizer_digest_is_read_from_the_file(users, settings, tmp_path):
    (tmp_path / "tok.json").write_text('{"model": {"type": "WordLevel"}}')
    settings.TOKENIZER_DIR = tmp_path
    platform = login("platform")
    body = {
        "name": "tok",
        "family": "byte-level-bpe",
        "source": "test",
        "file_name": "tok.json",
        "change_reason": "new",
    }
    assert platform.post(reverse("admin:budgeting_tokenizer_add"), body).status_code == 302
    tokenizer = Tokenizer.objects.get(name="tok")
    assert tokenizer.digest == "sha256:" + hashlib.sha256((tmp_path / "tok.json").read_bytes()).hexdigest()
    escape = platform.post(
        reverse("admin:budgeting_tokenizer_add"), {**body, "name": "x", "file_name": "../x"}
    )
    assert escape.status_code == 200 and "no file" in escape.content.decode()
    unknown = platform.post(
        reverse("admin:budgeting_tokenizer_add"), {**body, "name": "y", "family": "wordlevel"}
    )
    assert unknown.status_code == 200 and not Tokenizer.objects.filter(name="y").exists()
    # A JSON file is not a tiktoken vocabulary: the family decides how the file is read.
    wrong = platform.post(
        reverse("admin:budgeting_tokenizer_add"), {**body, "name": "z", "family": "o200k_base"}
    )
    assert wrong.status_code == 200 and "not a o200k_base tokenizer file" in wrong.content.decode()


def test_token_rotation_shows_the_new_token_once_and_can_revoke_the_old(users, cat):
    client = ServiceClientFactory(tenants=[cat.tenant])
    old = issue_token(client, "tb_old_token_aaaaaaaaaaaaaaaaaaaa")
    platform = login("platform")
    url = reverse("admin:budgeting_serviceclient_rotate", args=[client.pk])
    form = {"reason": "leaked in a log", "revoke_current": "on", "once": "a1b2"}
    html = platform.post(url, form).content.decode()
    new = html.split('class="tb-token tb-mono">')[1].split("<")[0]
    # Refreshing the page that showed the token posts the same form again: no second token, and the first
    # is not shown again.
    again = platform.post(url, form, follow=True)
    assert new not in again.content.decode() and "issued already" in again.content.decode()
    assert ApiToken.objects.filter(client=client).count() == 2
    assert new.startswith("tb_") and new not in page(platform, "budgeting_serviceclient_change", client.pk)
    reservation_url = "/api/v1/reservations/00000000-0000-0000-0000-000000000000"
    assert Client().get(reservation_url, HTTP_AUTHORIZATION=f"Bearer {old}").status_code == 401
    assert Client().get(reservation_url, HTTP_AUTHORIZATION=f"Bearer {new}").status_code == 404
    record = ChangeRecord.objects.get(action="client.token_rotate")
    assert record.after == {"newTokenPrefix": new[:8], "revokedTokens": 1}
    assert new not in str(record.after)  # only the prefix is kept


def test_token_revocation_goes_through_a_confirmation(users, cat):
    client = ServiceClientFactory(tenants=[cat.tenant])
    issue_token(client, "tb_some_token_aaaaaaaaaaaaaaaaaaa")
    token = ApiToken.objects.get(client=client)
    platform = login("platform")
    url = reverse("admin:budgeting_serviceclient_revoke_token", args=[client.pk, token.pk])
    assert "Revoke token" in platform.get(url).content.decode()
    assert ApiToken.objects.get(pk=token.pk).revoked_at is None
    assert platform.post(url, {"reason": "client retired"}).status_code == 302
    assert ApiToken.objects.get(pk=token.pk).revoked_at is not None
    assert ServiceClient.objects.get(pk=client.pk).tokens.filter(revoked_at__isnull=True).count() == 0


def test_billing_import_upload_settles_reconciling_and_reports_duplicates(users, scenario):
    unknown = scenario.reservations["unknown"]
    assert unknown.state == State.RECONCILING
    export = (
        "request_id,model,input_tokens,output_tokens,start_time\n"
        f"{unknown.provider_request_id},{scenario.model.name},700,40,2026-11-30T05:00:00+00:00\n"
        f"{unknown.provider_request_id},{scenario.model.name},700,40,2026-11-30T05:00:00+00:00\n"
    )
    finance = login("finance")
    upload = SimpleUploadedFile("export-nov.csv", export.encode(), content_type="text/csv")
    response = finance.post(
        reverse("admin:reconciliation_billingimport_upload"),
        {"export": upload, "fmt": "csv", "reason": "November export"},
        follow=True,
    )
    assert response.status_code == 200
    billing_import = BillingImport.objects.get()
    assert Reservation.objects.get(pk=unknown.pk).state == State.SETTLED
    assert BillingFinding.objects.filter(billing_import=billing_import, kind=FindingKind.DUPLICATE).exists()
    html = page(finance, "reconciliation_billingimport_change", billing_import.pk)
    assert "Duplicate" in html
    listing = page(finance, "reconciliation_billingimport_changelist")
    assert "export-nov.csv" in listing
    assert ChangeRecord.objects.get(action="billing.import").reason == "November export"


def test_revoking_a_temporary_increase_from_the_list_takes_it_back(users, scenario):
    account = CapacityAccount.objects.get(scope=Scope.TENANT, tenant=scenario.tenant)
    increase = limits.grant_temporary_increase(
        account_id=account.pk,
        input_tokens=0,
        output_tokens=5000,
        concurrency=0,
        expires_at=timezone.now() + timedelta(days=1),
        reason="promo",
        actor=Actor(None, "finance"),
        now=timezone.now(),
    )
    finance = login("finance")
    url = reverse("admin:budgeting_temporaryincrease_changelist")
    confirm = finance.post(url, {"action": "revoke", "_selected_action": [increase.pk]})
    assert "Revoke temporary increases" in confirm.content.decode()
    assert TemporaryIncrease.objects.get(pk=increase.pk).ended_at is None
    finance.post(url, {"action": "revoke", "_selected_action": [increase.pk], "reason": "promo cancelled"})
    assert TemporaryIncrease.objects.get(pk=increase.pk).end_reason == "revoked: promo cancelled"
    assert CapacityAccount.objects.get(pk=account.pk).output_limit == 100_000


def test_change_record_page_shows_before_and_after(users, scenario):
    account = CapacityAccount.objects.get(scope=Scope.TENANT, tenant=scenario.tenant)
    limits.post_correction(
        account_id=account.pk,
        input_consumed=-5,
        output_consumed=0,
        reason="refund",
        actor=Actor(None, "finance"),
    )
    record = ChangeRecord.objects.get(action="ledger.correction")
    html = page(login("finance"), "budgeting_changerecord_change", record.pk)
    assert f"<td>{account.input_consumed}</td><td>{account.input_consumed - 5}</td>" in html
    assert "refund" in html


def test_a_broken_catalog_rule_is_shown_on_its_field_in_words(users, scenario):
    finance = login("finance")
    body = {
        "model_revision": scenario.model.pk,
        "effective_from_0": (timezone.now() + timedelta(days=1)).date().isoformat(),
        "effective_from_1": "00:00:00",
        "currency": "usd",
        "input_per_million": "0.27",
        "output_per_million": "1.10",
        "note": "",
        "change_reason": "December prices",
    }
    response = finance.post(reverse("admin:budgeting_price_add"), body)
    html = response.content.decode()
    assert response.status_code == 200
    assert "Currency must be a three-letter ISO code, e.g. USD." in html
    assert "price_currency_iso" not in html and "Constraint" not in html
    errors = response.context["adminform"].form.errors
    assert errors["currency"] == ["Currency must be a three-letter ISO code, e.g. USD."]
    assert finance.post(reverse("admin:budgeting_price_add"), {**body, "currency": "USD"}).status_code == 302


def test_a_price_cannot_be_back_dated_or_edited_in_the_admin(users, scenario):
    finance = login("finance")
    body = {
        "model_revision": scenario.model.pk,
        "effective_from_0": "2026-01-02",
        "effective_from_1": "00:00:00",
        "currency": "USD",
        "input_per_million": "0.27",
        "output_per_million": "1.10",
        "note": "",
        "change_reason": "back-dated",
    }
    response = finance.post(reverse("admin:budgeting_price_add"), body)
    assert response.status_code == 200
    assert "A price cannot start in the past" in response.content.decode()
    price = Price.objects.get(model_revision=scenario.model)
    change = reverse("admin:budgeting_price_change", args=[price.pk])
    assert finance.post(change, {**body, "change_reason": "edit"}).status_code == 403
    assert Price.objects.get(pk=price.pk).input_per_million == Decimal("3")


def test_every_check_constraint_of_a_form_edited_model_has_words(users):
    audited = [m for m, a in admin.site._registry.items() if isinstance(a, AuditedAdmin)]
    unnamed = [
        constraint.name
        for model in audited
        for constraint in model._meta.constraints
        if isinstance(constraint, models.CheckConstraint) and constraint.name not in CONSTRAINT_WORDS
    ]
    assert unnamed == []
    below = next(c for c in ModelRevision._meta.constraints if c.name == "modelrevision_output_below_window")
    assert constraint_fields(below) == ["max_output"]


def test_the_billing_import_answers_with_a_sentence_and_a_table(users, scenario):
    unknown = scenario.reservations["unknown"]
    export = (
        "request_id,model,input_tokens,output_tokens,start_time\n"
        f"{unknown.provider_request_id},{scenario.model.name},700,40,2026-11-30T05:00:00+00:00\n"
        "prov-elsewhere,m,10,2,2026-11-30T05:00:00+00:00\n"
    )
    finance = login("finance")
    response = finance.post(
        reverse("admin:reconciliation_billingimport_upload"),
        {
            "export": SimpleUploadedFile("nov.csv", export.encode(), content_type="text/csv"),
            "fmt": "csv",
            "reason": "November export",
        },
        follow=True,
    )
    html = response.content.decode()
    message = next(str(m) for m in response.context["messages"])
    assert message.startswith("Imported nov.csv: 2 records, 1 reservation settled, ")
    assert "{" not in message and "'" not in message
    assert 'id="tb-import-result"' in html and "records read" in html
    assert "Fmt" not in html and "CSV (per request or per bucket)" in html
    assert "Fmt" not in page(finance, "reconciliation_billingimport_changelist")


def test_the_sample_billing_export_in_the_repository_is_accepted(users, scenario):
    sample = Path(settings.BASE_DIR) / "budgeting" / "demo" / "billing-sample.csv"
    response = login("finance").post(
        reverse("admin:reconciliation_billingimport_upload"),
        {
            "export": SimpleUploadedFile(sample.name, sample.read_bytes(), content_type="text/csv"),
            "fmt": "csv",
            "reason": "try the sample",
        },
        follow=True,
    )
    billing_import = BillingImport.objects.get()
    assert billing_import.records > 0
    assert not billing_import.findings.filter(kind=FindingKind.BAD_LINE).exists()
    assert "Imported billing-sample.csv" in response.content.decode()


def flag(reservation: Reservation) -> Reservation:
    assert settlement.flag_for_person(
        reservation_id=reservation.pk,
        fence=reservation.fence,
        reason="provider said not processed, but 40 output tokens were captured",
        now=timezone.now(),
    )
    return Reservation.objects.get(pk=reservation.pk)


def test_the_backlog_shows_reservations_needing_a_person_apart(users, scenario):
    unknown = flag(scenario.reservations["unknown"])
    html = page(login("finance"), "ledger_reservation_backlog")
    people = html[html.index('id="tb-needs-person"') : html.index("Waiting for evidence")]
    assert unknown.request_id in people and "40 output tokens were captured" in people
    assert reverse("admin:ledger_reservation_resolve", args=[unknown.pk]) in people
    assert "Nothing waits for evidence." in html
    analyst = page(login("analyst"), "ledger_reservation_backlog")
    assert unknown.request_id in analyst and "Resolve…" not in analyst
    listing = page(login("finance"), "ledger_reservation_changelist")
    assert "needs a person" in listing


def test_finance_resolves_a_reservation_with_a_reason_through_a_confirmation(users, scenario):
    unknown = flag(scenario.reservations["unknown"])
    finance = login("finance")
    url = reverse("admin:ledger_reservation_resolve", args=[unknown.pk])
    assert "What happened to this call" in finance.get(url).content.decode()
    body = {"step": "edit", "resolution": "NOT_PROCESSED", "reason": "provider confirmed: never ran"}
    confirm = finance.post(url, body).content.decode()
    assert "What changes" in confirm and "gives those tokens back" in confirm
    assert Reservation.objects.get(pk=unknown.pk).state == State.RECONCILING
    done = finance.post(url, {**body, "step": "confirm"})
    assert done.status_code == 302
    settled = Reservation.objects.get(pk=unknown.pk)
    assert settled.state == State.SETTLED and settled.input_consumed == 0
    record = ChangeRecord.objects.get(action="reservation.resolve.not_processed")
    assert record.actor_username == "finance" and record.reason == "provider confirmed: never ran"
    assert finance.get(url).status_code == 200  # the page still opens; the service refuses a second time
    again = finance.post(url, {**body, "step": "confirm"}, follow=True).content.decode()
    assert "only a RECONCILING reservation can be resolved" in again


def test_a_billed_resolution_needs_both_amounts_on_their_fields(users, scenario):
    unknown = flag(scenario.reservations["unknown"])
    url = reverse("admin:ledger_reservation_resolve", args=[unknown.pk])
    body = {"step": "edit", "resolution": "AS_BILLED", "input_tokens": "1,200", "reason": "invoice 7"}
    response = login("finance").post(url, body)
    assert response.context["form"].errors == {
        "output_tokens": ["Give the amount the provider billed (0 if none)."]
    }
    assert login("analyst").get(url).status_code == 403


def test_wide_lists_are_formatted_and_name_their_units(users, scenario):
    finance = login("finance")
    entries = page(finance, "ledger_ledgerentry_changelist").lower()
    assert "+1,000" in entries and "-1,000" in entries and "input tokens reserved" in entries
    reservations = page(finance, "ledger_reservation_changelist").lower()
    assert "output tokens captured / held" in reservations and "2,000" in reservations
    accounts = page(finance, "ledger_capacityaccount_changelist").lower()
    assert "input limit (tokens)" in accounts and "1,000,000" in accounts
