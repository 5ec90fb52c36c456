"""Finance's edits (issue 19 §3): a limit edit during a temporary increase changes the permanent limit only; a
file that is not a billing export of its format is refused and stores nothing, and a failed import can be
removed with a reason; sub-cent spend adds up; lifting a sign-in lockout has a reason and a change-log entry,
failed sign-ins are listed, and the lockout page has the product's name."""

from __future__ import annotations

import re
from datetime import timedelta
from decimal import Decimal
from io import StringIO
from pathlib import Path

import pytest
from axes.models import AccessAttempt, AccessFailureLog
from django.conf import settings
from django.core.files.uploadedfile import SimpleUploadedFile
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from budgeting.backoffice import formats
from budgeting.catalog.changes import Actor
from budgeting.catalog.models import ChangeRecord
from ledger.models import CapacityAccount
from ledger.services import limits
from reconciliation.models import BillingFinding, BillingImport, FindingKind
from tests.admin.conftest import PASSWORD, login

pytestmark = pytest.mark.django_db
SAMPLE = Path(settings.BASE_DIR) / "budgeting" / "demo" / "billing-sample.csv"
FINANCE = Actor(user_id=None, username="finance")


def grant(account: CapacityAccount, input_tokens: int, *, days: int = 3) -> int:
    now = timezone.now()
    return limits.grant_temporary_increase(
        account_id=account.pk,
        input_tokens=input_tokens,
        output_tokens=0,
        concurrency=0,
        expires_at=now + timedelta(days=days),
        reason="quarter-end push",
        actor=FINANCE,
        now=now,
    ).pk


# §3.1 ------------------------------------------------------------------------------------------------------


def test_a_limit_edit_during_a_temporary_increase_changes_the_permanent_limit_only(users, cat):
    account = cat.tenant.accounts.get()
    CapacityAccount.objects.filter(pk=account.pk).update(input_limit=12_000_000)
    increase = grant(account, 2_000_000)
    account.refresh_from_db()
    assert account.input_limit == 14_000_000  # what admission reads: permanent + temporary
    finance = login("finance")
    url = reverse("admin:ledger_capacityaccount_limits", args=[account.pk])
    form = finance.get(url).content.decode()
    # The form shows the permanent limit, and the increase apart, not 14 M folded into one figure.
    assert re.search(
        r'id="id_input_limit"[^>]*value="12,000,000"|value="12,000,000"[^>]*id="id_input_limit"', form
    )
    assert "+2,000,000" in form and "Active temporary increases" in form
    body = {
        "input_limit": "12,500,000",
        "output_limit": account.output_limit,
        "concurrency_limit": account.concurrency_limit,
        "expected_input": account.input_limit,
        "expected_output": account.output_limit,
        "expected_concurrency": account.concurrency_limit,
        "reason": "Q4 budget approved",
    }
    confirm = finance.post(url, {**body, "step": "edit"}).content.decode()
    assert "input permanent limit" in confirm and "input limit in force" in confirm
    assert finance.post(url, {**body, "step": "confirm"}).status_code == 302
    assert CapacityAccount.objects.get(pk=account.pk).input_limit == 14_500_000
    record = ChangeRecord.objects.get(action="account.limits")
    assert record.before["permanent"]["input_limit"] == 12_000_000
    assert record.after["permanent"]["input_limit"] == 12_500_000
    assert record.after["temporaryIncreases"] == {"input": 2_000_000}
    # When the increase ends, finance's 12.5 M stays (it dropped to 10.5 M before).
    assert limits.end_temporary_increase(
        increase_id=increase, reason="expired", actor=FINANCE, now=timezone.now()
    )
    assert CapacityAccount.objects.get(pk=account.pk).input_limit == 12_500_000


def test_the_account_page_shows_the_permanent_limit_and_the_increase_apart(users, cat):
    account = cat.tenant.accounts.get()
    grant(account, 250_000)
    html = (
        login("finance")
        .get(reverse("admin:ledger_capacityaccount_change", args=[account.pk]))
        .content.decode()
    )
    assert "1,250,000" in html and "1,000,000 permanent +250,000 temporary" in html


def test_a_permanent_limit_edit_is_compare_and_swap_on_the_limit_in_force(cat):
    account = cat.tenant.accounts.get()
    grant(account, 100)
    with pytest.raises(limits.LimitsChanged):
        limits.set_permanent_limits(
            account_id=account.pk,
            input_limit=5,
            output_limit=None,
            concurrency_limit=None,
            spend_limit=None,
            expected=(1_000_000, 100_000, 10, None),  # seen before the increase
            reason="x",
            actor=FINANCE,
        )
    assert CapacityAccount.objects.get(pk=account.pk).input_limit == 1_000_100


# §3.2 ------------------------------------------------------------------------------------------------------


def upload(name: str, content: bytes, fmt: str):
    return login("finance").post(
        reverse("admin:reconciliation_billingimport_upload"),
        {
            "export": SimpleUploadedFile(name, content, content_type="text/plain"),
            "fmt": fmt,
            "reason": "monthly",
        },
        follow=True,
    )


def test_an_export_with_the_wrong_columns_is_refused_with_the_reason_and_nothing_stored(users, scenario):
    response = upload("people.csv", b"name,email,team\nana,ana@example.com,eu\nbo,bo@example.com,us\n", "csv")
    html = response.content.decode()
    assert "people.csv is not a CSV (per request or per bucket) export" in html
    assert "request_id" in html and "bucket_start" in html  # the columns it needs
    assert not [m for m in response.context["messages"] if m.level_tag == "success"]
    assert not BillingImport.objects.exists() and not BillingFinding.objects.exists()
    assert not ChangeRecord.objects.filter(action="billing.import").exists()


def test_the_right_file_under_the_wrong_format_is_refused(users, scenario):
    html = upload(SAMPLE.name, SAMPLE.read_bytes(), "jsonl").content.decode()
    assert (
        "is not a JSON lines (per request or per bucket) export: no line could be read (line 1: not JSON"
        in html
    )
    assert not BillingImport.objects.exists()
    html = upload(SAMPLE.name, SAMPLE.read_bytes(), "openai-usage").content.decode()
    assert "is not a OpenAI usage API" in html and not BillingImport.objects.exists()


def test_the_import_command_refuses_a_file_that_is_not_an_export(tmp_path, db):
    path = tmp_path / "people.csv"
    path.write_text("name,email\nana,ana@example.com\n")
    with pytest.raises(CommandError, match="is not a CSV"):
        call_command("import_billing", str(path), stdout=StringIO())
    assert not BillingImport.objects.exists()


def failed_import() -> BillingImport:
    """An import accepted before refusals existed: no record, only its bad lines."""
    billing_import = BillingImport.objects.create(source="people.csv", fmt="csv", content_sha256="f" * 64)
    BillingFinding.objects.create(
        billing_import=billing_import, kind=FindingKind.BAD_LINE, line=2, detail="bad"
    )
    return billing_import


def test_finance_removes_a_failed_import_with_a_reason_and_the_change_log_keeps_it(users, scenario):
    billing_import = failed_import()
    finance = login("finance")
    page = finance.get(reverse("admin:reconciliation_billingimport_change", args=[billing_import.pk]))
    assert "Remove this import…" in page.content.decode()
    url = reverse("admin:reconciliation_billingimport_remove", args=[billing_import.pk])
    assert "Remove import" in finance.get(url).content.decode()
    assert finance.post(url, {"reason": ""}).status_code == 200  # a reason is required
    assert BillingImport.objects.filter(pk=billing_import.pk).exists()
    assert finance.post(url, {"reason": "not a billing export"}).status_code == 302
    assert not BillingImport.objects.filter(pk=billing_import.pk).exists()
    record = ChangeRecord.objects.get(action="billing.remove_import")
    assert record.reason == "not a billing export" and record.before["source"] == "people.csv"
    assert record.before["findings"] == ["bad"] and record.after is None


def test_an_import_that_stored_records_cannot_be_removed(users, scenario):
    upload(SAMPLE.name, SAMPLE.read_bytes(), "csv")
    billing_import = BillingImport.objects.get()
    finance = login("finance")
    page = finance.get(reverse("admin:reconciliation_billingimport_change", args=[billing_import.pk]))
    assert "Remove this import…" not in page.content.decode()
    url = reverse("admin:reconciliation_billingimport_remove", args=[billing_import.pk])
    response = finance.post(url, {"reason": "oops"}, follow=True)
    assert "only an import that stored nothing can be removed" in response.content.decode()
    assert BillingImport.objects.filter(pk=billing_import.pk).exists()
    assert login("analyst").post(url, {"reason": "x"}).status_code == 403


# §3.3 ------------------------------------------------------------------------------------------------------


def test_sub_cent_amounts_are_shown_at_the_precision_that_adds_up():
    rows = [{"USD": Decimal("0.004")}, {"USD": Decimal("0.004")}, {"USD": Decimal("0.004")}]
    places = formats.money_places(rows, {"USD": Decimal("0.012")})
    assert places == {"USD": 3}
    assert [formats.money(r["USD"], "USD", places["USD"]) for r in rows] == ["$0.004"] * 3
    assert formats.money(Decimal("0.012"), "USD", places["USD"]) == "$0.012"
    # Alone, a sub-cent amount says so rather than "$0.00".
    assert (
        formats.money(Decimal("0.004"), "USD") == "< $0.01" and formats.money(Decimal("0"), "USD") == "$0.00"
    )
    assert formats.money_places([{"USD": Decimal("1.25")}], {"USD": Decimal("1.25")}) == {"USD": 2}
    assert formats.money_places([{"JPY": Decimal("0.4")}], {"JPY": Decimal("0.4")}) == {"JPY": 1}


def amount(text: str) -> Decimal:
    return Decimal(text.strip().replace("$", "").replace(",", ""))


def test_the_report_rows_add_up_to_the_total_shown(users, scenario):
    html = login("finance").get(reverse("admin:budgeting_usagereport_changelist")).content.decode()
    total = re.search(r'id="tb-report-cost"><small>cost</small><b class="tb-money">([^<]+)</b>', html)
    assert total is not None
    cells = re.findall(r'data-label="cost">(\$[0-9.,]+)</td>', html)
    assert len(cells) > 1 and "$0.00" not in cells
    assert sum(map(amount, cells)) == amount(total.group(1))


# §3.4 ------------------------------------------------------------------------------------------------------


def fail_sign_in(username: str, times: int) -> int:
    status = 0
    for _ in range(times):
        status = (
            Client()
            .post(reverse("admin:login"), {"username": username, "password": "wrong"}, REMOTE_ADDR="10.1.2.3")
            .status_code
        )
    return status


def test_lifting_a_lockout_asks_for_a_reason_and_lands_in_the_change_log(users, settings):
    settings.AXES_FAILURE_LIMIT = 3
    assert fail_sign_in("finance", 3) == 429
    lockouts = reverse("admin:axes_accessattempt_changelist")
    platform = login("platform")
    listing = platform.get(lockouts).content.decode()
    assert "locked out" in listing and "Lift the selected lockouts" in listing
    assert "delete_selected" not in listing  # no generic delete
    rows = list(AccessAttempt.objects.values_list("pk", flat=True))
    asked = platform.post(lockouts, {"action": "lift", "_selected_action": rows})
    assert "Lift sign-in lockouts" in asked.content.decode() and AccessAttempt.objects.exists()
    lifted = platform.post(
        lockouts, {"action": "lift", "_selected_action": rows, "reason": "called the helpdesk"}
    )
    assert lifted.status_code == 302 and not AccessAttempt.objects.exists()
    record = ChangeRecord.objects.get(action="axes.lift_lockout")
    assert record.reason == "called the helpdesk" and record.actor_username == "platform"
    assert record.before["username"] == "finance" and record.before["failures_since_start"] == 3
    signed_in = Client().post(reverse("admin:login"), {"username": "finance", "password": PASSWORD})
    assert signed_in.status_code == 302


def test_access_failures_lists_the_failed_sign_ins(users, settings):
    settings.AXES_FAILURE_LIMIT = 5
    fail_sign_in("finance", 2)
    assert AccessFailureLog.objects.filter(username="finance").count() == 2
    html = login("platform").get(reverse("admin:axes_accessfailurelog_changelist")).content.decode()
    assert html.count("finance") >= 2 and "0 access failures" not in html


def test_the_lockout_page_has_the_products_look(users, settings):
    settings.AXES_FAILURE_LIMIT = 2
    fail_sign_in("analyst", 1)
    locked = Client().post(
        reverse("admin:login"), {"username": "analyst", "password": "wrong"}, REMOTE_ADDR="10.1.2.3"
    )
    html = locked.content.decode()
    assert locked.status_code == 429 and "Signing in is locked for now" in html
    assert "Django administration" not in html and "Django site admin" not in html
    assert '<div id="site-name"><a href="/admin/">Token budget</a></div>' in html
