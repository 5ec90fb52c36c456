"""Finance's account work: limits with a preview and a below-use warning, temporary increases that expire,
compensating corrections; every change in the change log, balances always the sum of their entries."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.db import IntegrityError, InternalError, connection, transaction
from django.urls import reverse

from budgeting.backoffice.reports.spend import RUN_RATE_DAYS, account_spend, spend
from budgeting.catalog.changes import SYSTEM, Actor
from budgeting.catalog.errors import InvalidChange
from budgeting.catalog.models import ChangeRecord, PolicyState, PolicyVersion, TemporaryIncrease
from ledger import selectors
from ledger.errors import LimitsChanged, QuotaExceeded
from ledger.models import CapacityAccount, EntryKind, LedgerEntry, Scope
from ledger.services import limits
from tests.admin.conftest import login
from tests.ledger.helpers import admit, catalog, now, run_concurrently, spec, tenant_account

pytestmark = pytest.mark.django_db
ALICE = Actor(user_id=None, username="alice")


def tenant_acc(scenario) -> CapacityAccount:
    return CapacityAccount.objects.get(scope=Scope.TENANT, tenant=scenario.tenant)


def limits_url(account: CapacityAccount) -> str:
    return reverse("admin:ledger_capacityaccount_limits", args=[account.pk])


def form(account: CapacityAccount, step: str, **limits: int | str) -> dict[str, object]:
    return {
        "step": step,
        "reason": "quarterly budget",
        "input_limit": limits.get("input_limit", account.input_limit or ""),
        "output_limit": limits.get("output_limit", account.output_limit or ""),
        "concurrency_limit": limits.get("concurrency_limit", account.concurrency_limit or ""),
        "expected_input": account.input_limit or "",
        "expected_output": account.output_limit or "",
        "expected_concurrency": account.concurrency_limit or "",
        **({"acknowledge": "on"} if limits.get("acknowledge") else {}),
    }


def test_preview_shows_availability_and_flags_a_limit_below_use(scenario):
    account = tenant_acc(scenario)
    in_use = account.input_reserved + account.input_consumed
    assert in_use > 100
    dims = limits.preview_limits(
        account,
        input_limit=100,
        output_limit=None,
        concurrency_limit=account.concurrency_limit,
        spend_limit=None,
    )
    by_name = {d.name: d for d in dims}
    assert by_name["input"].new_available == 100 - in_use
    assert by_name["input"].below_use
    assert by_name["output"].new_available is None and not by_name["output"].below_use
    assert not by_name["concurrency"].changed


def test_raising_a_limit_through_the_admin_previews_then_saves_and_logs(users, scenario):
    account = tenant_acc(scenario)
    finance = login("finance")
    preview = finance.post(limits_url(account), form(account, "edit", input_limit=3_000_000))
    assert preview.status_code == 200
    html = preview.content.decode()
    assert "What changes" in html and "3,000,000" in html
    assert CapacityAccount.objects.get(pk=account.pk).input_limit == account.input_limit  # not saved yet
    done = finance.post(limits_url(account), form(account, "confirm", input_limit=3_000_000))
    assert done.status_code == 302
    assert CapacityAccount.objects.get(pk=account.pk).input_limit == 3_000_000
    record = ChangeRecord.objects.get(action="account.limits")
    assert record.actor_username == "finance"
    assert record.before["input_limit"] == 1_000_000 and record.after["input_limit"] == 3_000_000
    assert record.reason == "quarterly budget"
    log = (
        login("finance")
        .get(reverse("admin:budgeting_changerecord_change", args=[record.pk]))
        .content.decode()
    )
    assert "1000000" in log and "3000000" in log


def test_lowering_below_use_is_warned_needs_acknowledgement_and_then_refuses_admissions(users, cat):
    account = CapacityAccount.objects.get(scope=Scope.TENANT, tenant=cat.tenant)
    admit(spec(cat, input_tokens=500, output_tokens=50))
    account.refresh_from_db()
    finance = login("finance")
    warned = finance.post(limits_url(account), form(account, "edit", input_limit=100)).content.decode()
    assert "below current use" in warned
    unacknowledged = finance.post(limits_url(account), form(account, "confirm", input_limit=100))
    assert unacknowledged.status_code == 200
    assert "Tick the box" in unacknowledged.content.decode()
    assert CapacityAccount.objects.get(pk=account.pk).input_limit == 1_000_000
    saved = finance.post(limits_url(account), form(account, "confirm", input_limit=100, acknowledge=True))
    assert saved.status_code == 302
    assert CapacityAccount.objects.get(pk=account.pk).input_limit == 100
    with pytest.raises(QuotaExceeded):
        admit(spec(cat, input_tokens=1, output_tokens=1))


def test_limits_changed_meanwhile_are_not_overwritten(scenario):
    account = tenant_acc(scenario)
    seen = limits.limits_in_force(account)
    CapacityAccount.objects.filter(pk=account.pk).update(input_limit=5)
    with pytest.raises(LimitsChanged):
        limits.set_account_limits(
            account_id=account.pk,
            input_limit=9,
            output_limit=seen[1],
            concurrency_limit=seen[2],
            spend_limit=seen[3],
            expected=seen,
            reason="r",
            actor=ALICE,
        )
    assert CapacityAccount.objects.get(pk=account.pk).input_limit == 5
    assert not ChangeRecord.objects.exists()


def test_a_limit_edit_never_touches_balances_moved_meanwhile():
    cat = catalog(tenant_slug="t-own")
    account = tenant_account(cat, input_limit=10_000, output_limit=10_000)
    stale = CapacityAccount.objects.get(pk=account.pk)
    admit(spec(cat, input_tokens=300, output_tokens=30))
    limits.set_account_limits(
        account_id=stale.pk,
        input_limit=20_000,
        output_limit=10_000,
        concurrency_limit=None,
        spend_limit=None,
        expected=(10_000, 10_000, None, None),
        reason="r",
        actor=ALICE,
    )
    fresh = CapacityAccount.objects.get(pk=account.pk)
    assert (fresh.input_reserved, fresh.input_limit) == (300, 20_000)
    assert selectors.audit().ok


def test_reason_is_required():
    with pytest.raises(InvalidChange):
        limits.post_correction(account_id=1, input_consumed=1, output_consumed=0, reason=" ", actor=ALICE)


def test_temporary_increase_raises_limits_until_it_expires_once(scenario):
    account = tenant_acc(scenario)
    start = datetime.now(UTC)
    increase = limits.grant_temporary_increase(
        account_id=account.pk,
        input_tokens=500_000,
        output_tokens=0,
        concurrency=5,
        expires_at=start + timedelta(hours=1),
        reason="launch week",
        actor=ALICE,
        now=start,
    )
    raised = CapacityAccount.objects.get(pk=account.pk)
    assert (raised.input_limit, raised.concurrency_limit) == (1_500_000, 15)
    assert limits.expire_temporary_increases(now=start + timedelta(minutes=59)) == 0
    assert limits.expire_temporary_increases(now=start + timedelta(hours=1)) == 1
    assert limits.expire_temporary_increases(now=start + timedelta(hours=2)) == 0
    back = CapacityAccount.objects.get(pk=account.pk)
    assert (back.input_limit, back.concurrency_limit) == (1_000_000, 10)
    increase.refresh_from_db()
    assert increase.end_reason == "expired"
    actions = list(ChangeRecord.objects.order_by("id").values_list("action", "actor_username"))
    assert actions == [
        ("account.temporary_increase", "alice"),
        ("account.temporary_increase_end", SYSTEM.username),
    ]


def test_an_increase_of_an_unlimited_dimension_is_refused():
    cat = catalog(tenant_slug="t-own")
    account = tenant_account(cat, input_limit=None, output_limit=10)
    with pytest.raises(InvalidChange, match="unlimited"):
        limits.grant_temporary_increase(
            account_id=account.pk,
            input_tokens=10,
            output_tokens=0,
            concurrency=0,
            expires_at=now() + timedelta(hours=1),
            reason="r",
            actor=ALICE,
            now=now(),
        )
    assert not TemporaryIncrease.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_two_expiry_runs_at_once_end_an_increase_exactly_once():
    cat = catalog()
    account = tenant_account(cat, input_limit=1000, output_limit=1000)
    start = now()
    limits.grant_temporary_increase(
        account_id=account.pk,
        input_tokens=100,
        output_tokens=0,
        concurrency=0,
        expires_at=start + timedelta(seconds=1),
        reason="r",
        actor=ALICE,
        now=start,
    )
    results = run_concurrently(
        6, lambda i: limits.expire_temporary_increases(now=start + timedelta(seconds=5))
    )
    assert sorted(results) == [0, 0, 0, 0, 0, 1]
    assert CapacityAccount.objects.get(pk=account.pk).input_limit == 1000


def test_correction_is_a_new_entry_and_balances_stay_the_sum_of_entries(scenario):
    account = tenant_acc(scenario)
    consumed = account.output_consumed
    entry = limits.post_correction(
        account_id=account.pk, input_consumed=0, output_consumed=-30, reason="provider credit", actor=ALICE
    )
    assert (entry.kind, entry.reservation_id, entry.created_by) == (EntryKind.CORRECTION, None, "alice")
    assert CapacityAccount.objects.get(pk=account.pk).output_consumed == consumed - 30
    assert selectors.audit().violations == []
    with pytest.raises(InvalidChange, match="negative"):
        limits.post_correction(
            account_id=account.pk, input_consumed=0, output_consumed=-(10**9), reason="r", actor=ALICE
        )
    assert LedgerEntry.objects.filter(kind=EntryKind.CORRECTION, reservation=None).count() == 1


def test_correction_through_the_admin_shows_the_effect_first(users, scenario):
    account = tenant_acc(scenario)
    url = reverse("admin:ledger_capacityaccount_correction", args=[account.pk])
    finance = login("finance")
    body = {"reason": "billing credit", "input_consumed": "-100", "output_consumed": "0"}
    preview = finance.post(url, {**body, "step": "edit"}).content.decode()
    assert "input consumed" in preview and f"{account.input_consumed - 100:,}" in preview
    assert not LedgerEntry.objects.filter(kind=EntryKind.CORRECTION, reservation=None).exists()
    assert finance.post(url, {**body, "step": "confirm"}).status_code == 302
    assert LedgerEntry.objects.filter(kind=EntryKind.CORRECTION, reservation=None).count() == 1


def test_the_change_log_and_validated_policies_cannot_be_edited_in_the_database(scenario):
    record = ChangeRecord.objects.create(
        actor_username="a", action="x", target_type="t.t", target_id="1", target_repr="r", reason="r"
    )
    with pytest.raises((IntegrityError, InternalError)), transaction.atomic():
        ChangeRecord.objects.filter(pk=record.pk).update(reason="rewritten")
    version = PolicyVersion.objects.create(revision=77, state=PolicyState.VALIDATED, document={"a": 1})
    with pytest.raises((IntegrityError, InternalError)), transaction.atomic():
        PolicyVersion.objects.filter(pk=version.pk).update(document={"a": 2})
    with pytest.raises((IntegrityError, InternalError)), transaction.atomic():
        PolicyVersion.objects.filter(pk=version.pk).delete()
    PolicyVersion.objects.filter(pk=version.pk).update(note="notes may change")
    with connection.cursor() as cursor:
        cursor.execute("SELECT reason FROM budgeting_changerecord WHERE id = %s", [record.pk])
        assert cursor.fetchone()[0] == "r"


def test_limit_inputs_accept_thousands_separators_and_show_them_back(users, scenario):
    account = tenant_acc(scenario)
    finance = login("finance")
    assert 'value="1,000,000"' in finance.get(limits_url(account)).content.decode()
    preview = finance.post(limits_url(account), form(account, "edit", input_limit="12,000,000"))
    html = preview.content.decode()
    assert "What changes" in html and "12,000,000" in html
    finance.post(limits_url(account), form(account, "confirm", input_limit="12,000,000"))
    assert CapacityAccount.objects.get(pk=account.pk).input_limit == 12_000_000


def test_a_limit_that_is_not_a_whole_number_is_refused_on_its_field(users, scenario):
    account = tenant_acc(scenario)
    html = (
        login("finance")
        .post(limits_url(account), form(account, "edit", input_limit="12 million"))
        .content.decode()
    )
    assert "Enter a whole number, e.g. 12,000,000." in html
    assert "What changes" not in html


def test_account_page_shows_cost_to_date_a_projection_and_signed_movements(users, scenario):
    account = tenant_acc(scenario)
    html = (
        login("finance")
        .get(reverse("admin:ledger_capacityaccount_change", args=[account.pk]))
        .content.decode()
    )
    # 5,010 input tokens at $3 and 310 output tokens at $15 per 1M tokens: $0.01968.
    assert 'id="tb-cost-to-date"' in html and "$0.02" in html
    assert "projected for" in html
    assert "+1,000" in html and "-1,000" in html  # the full request's hold, then its post
    assert "input tokens" in html and "concurrent requests" in html


def test_spend_projects_the_recent_rate_to_the_end_of_the_month(scenario):
    moment = datetime.now(UTC)
    result = spend(now=moment, tenant=scenario.tenant.slug)
    assert result.to_date == {"USD": Decimal("0.019680")}
    assert result.requests == 5 and result.unpriced_requests == 0
    left = Decimal((result.month_end - moment).total_seconds()) / Decimal(RUN_RATE_DAYS * 86400)
    assert result.projected == {"USD": (Decimal("0.019680") * (1 + left)).quantize(Decimal("0.000001"))}
    pool = account_spend(CapacityAccount.objects.get(scope=Scope.POOL, pool=scenario.pool), moment)
    assert pool.to_date == result.to_date
    assert spend(now=moment, tenant="t-nobody").to_date == {}
