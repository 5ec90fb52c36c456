"""Finance sets an account's spend limit in the admin (issue 19 §1): an amount of the account's
currency typed as finance writes it, kept in micro-units, through the one limits edit (a reason, the change
log, the check that the limits are those the person saw); refused with a form error when it is not an
amount, and the next admission holds against it (429 naming the spend dimension)."""

from __future__ import annotations

import dataclasses
import re
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.contrib.messages import get_messages
from django.urls import reverse
from django.utils import timezone

from budgeting.catalog.changes import Actor
from budgeting.catalog.models import ChangeRecord, Price, TemporaryIncrease
from budgeting.catalog.prices import FrozenPrice, cost, from_micro
from ledger.errors import QuotaExceeded
from ledger.models import CapacityAccount, Scope
from ledger.services import limits
from tests.admin.conftest import login
from tests.api import test_money_end_to_end as api
from tests.ledger.helpers import Catalog, admit, catalog, spec, tenant_account

FINANCE = Actor(user_id=None, username="finance")


def limits_url(account: CapacityAccount) -> str:
    return reverse("admin:ledger_capacityaccount_limits", args=[account.pk])


def form(account: CapacityAccount, step: str, spend: str, **extra: object) -> dict[str, object]:
    """The limits form as the account's page fills it, with ``spend`` typed in the spend box."""
    return {
        "step": step,
        "reason": "FY27 budget approved",
        "input_limit": account.input_limit or "",
        "output_limit": account.output_limit or "",
        "concurrency_limit": account.concurrency_limit or "",
        "spend_limit": spend,
        "expected_input": account.input_limit or "",
        "expected_output": account.output_limit or "",
        "expected_concurrency": account.concurrency_limit or "",
        "expected_spend": "" if account.spend_limit is None else account.spend_limit,
        **extra,
    }


def spend_box(html: str) -> str:
    match = re.search(r'<input[^>]*name="spend_limit"[^>]*>', html)
    assert match, "the form has a spend box"
    value = re.search(r'value="([^"]*)"', match.group(0))
    return value.group(1) if value else ""


def tenant(cat) -> CapacityAccount:
    return CapacityAccount.objects.get(scope=Scope.TENANT, tenant=cat.tenant)


@pytest.mark.django_db
def test_finance_sets_a_spend_limit_as_money_and_the_change_log_keeps_it(users, cat):
    account = tenant(cat)
    assert account.spend_limit is None and account.currency == "USD"
    finance = login("finance")
    page = finance.get(limits_url(account)).content.decode()
    assert "Permanent spend per period (USD)" in page and spend_box(page) == ""

    confirm = finance.post(limits_url(account), form(account, "edit", "$5,000.00")).content.decode()
    assert "spend (USD) limit" in confirm and "$5,000.00" in confirm
    assert tenant(cat).spend_limit is None  # not saved before the confirmation
    done = finance.post(limits_url(account), form(account, "confirm", "5,000.00"))
    assert done.status_code == 302
    assert tenant(cat).spend_limit == 5_000_000_000  # micro-dollars
    record = ChangeRecord.objects.get(action="account.limits")
    assert (record.before["spend_limit"], record.after["spend_limit"]) == (None, 5_000_000_000)
    assert record.after["permanent"]["spend_limit"] == 5_000_000_000
    assert record.reason == "FY27 budget approved" and record.actor_username == "finance"

    shown = finance.get(reverse("admin:ledger_capacityaccount_change", args=[account.pk])).content.decode()
    assert "$5,000.00" in shown and "spend <span" in shown
    assert spend_box(finance.get(limits_url(account)).content.decode()) == "5,000.00"


@pytest.mark.django_db
def test_finance_changes_a_spend_limit_to_the_micro_unit_and_clears_it(users, cat):
    account = tenant(cat)
    CapacityAccount.objects.filter(pk=account.pk).update(spend_limit=5_000_000_000)
    account.refresh_from_db()
    finance = login("finance")
    assert finance.post(limits_url(account), form(account, "confirm", "1 250.000125")).status_code == 302
    account.refresh_from_db()
    assert account.spend_limit == 1_250_000_125
    assert spend_box(finance.get(limits_url(account)).content.decode()) == "1,250.000125"

    assert finance.post(limits_url(account), form(account, "confirm", "")).status_code == 302
    assert tenant(cat).spend_limit is None
    cleared = ChangeRecord.objects.filter(action="account.limits").order_by("-id").first()
    assert cleared is not None
    assert (cleared.before["spend_limit"], cleared.after["spend_limit"]) == (1_250_000_125, None)
    # The token limits were left as they were.
    assert cleared.after["input_limit"] == cleared.before["input_limit"] == 1_000_000


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("typed", "error"),
    [
        ("-5", "An amount cannot be negative."),
        ("-0.01", "An amount cannot be negative."),
        ("0.0000001", "At most 6 decimal places (a micro-unit of USD)."),
        ("12.3456789", "At most 6 decimal places (a micro-unit of USD)."),
        ("five thousand", "Enter an amount, e.g. 5,000.00."),
        ("1e3", "Enter an amount, e.g. 5,000.00."),
        ("NaN", "Enter an amount, e.g. 5,000.00."),
        ("Infinity", "Enter an amount, e.g. 5,000.00."),
        ("5.000.00", "Enter an amount, e.g. 5,000.00."),
        ("€5", "Enter an amount, e.g. 5,000.00."),
        ("99999999999999", "The amount is too large."),
    ],
)
def test_what_is_not_an_amount_is_a_form_error_and_nothing_is_written(users, cat, typed, error):
    account = tenant(cat)
    finance = login("finance")
    for step in ("edit", "confirm"):
        response = finance.post(limits_url(account), form(account, step, typed))
        assert response.status_code == 200
        assert error in response.content.decode()
    assert tenant(cat).spend_limit is None
    assert not ChangeRecord.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize("role", ["platform", "analyst", "nobody"])
def test_only_finance_may_set_a_spend_limit(users, cat, role):
    account = tenant(cat)
    response = login(role).post(limits_url(account), form(account, "confirm", "100"))
    assert response.status_code == 403
    assert tenant(cat).spend_limit is None
    assert not ChangeRecord.objects.exists()


@pytest.mark.django_db
def test_a_spend_limit_changed_since_the_form_was_shown_is_not_overwritten(users, cat):
    account = tenant(cat)
    seen = form(account, "confirm", "100")  # shown while the account had no spend limit
    limits.set_account_limits(
        account_id=account.pk,
        input_limit=account.input_limit,
        output_limit=account.output_limit,
        concurrency_limit=account.concurrency_limit,
        spend_limit=20_000_000,
        expected=limits.limits_in_force(account),
        reason="provisioned",
        actor=FINANCE,
    )
    response = login("finance").post(limits_url(account), seen)
    assert response.status_code == 302
    assert tenant(cat).spend_limit == 20_000_000
    assert [str(m) for m in get_messages(response.wsgi_request)] == [
        "The account's limits changed since the page was loaded: the limits changed since you looked at "
        "them; review the new values and confirm again"
    ]
    assert ChangeRecord.objects.filter(action="account.limits").count() == 1


@pytest.mark.django_db(transaction=True)
def test_the_next_admission_holds_against_the_spend_limit_finance_set(demo_api, users):
    account = CapacityAccount.objects.get(scope=Scope.TENANT, tenant__slug="t-19")
    assert account.spend_limit is None
    first = api.admit(demo_api, "spend-admin-1")
    assert first.status_code == 201, first.content[:300]
    tokens = first.json()["tokens"]
    hold = cost(tokens["input"], api.IN_PRICE) + cost(tokens["maxOutput"], api.OUT_PRICE)
    account.refresh_from_db()
    used = account.spend_reserved + account.spend_consumed
    assert used == hold

    # One micro-dollar short of a second hold.
    limit = used + hold - 1
    finance = login("finance")
    typed = f"{from_micro(limit):f}"
    assert finance.post(limits_url(account), form(account, "confirm", typed)).status_code == 302
    assert CapacityAccount.objects.get(pk=account.pk).spend_limit == limit

    refused = api.admit(demo_api, "spend-admin-2")
    assert refused.status_code == 429, refused.content[:300]
    problem = refused.json()
    assert (problem["code"], problem["dimension"], problem["currency"]) == ("QUOTA_EXCEEDED", "spend", "USD")
    assert (problem["requested"], problem["available"]) == (hold, hold - 1)

    account.refresh_from_db()
    raised = Decimal(typed) + Decimal("0.000001")
    assert finance.post(limits_url(account), form(account, "confirm", f"{raised:f}")).status_code == 302
    assert api.admit(demo_api, "spend-admin-3").status_code == 201


# A temporary spend increase (issue 19 §3.1): money beside the token increases, shown apart from the base --


def increase_form(spend: str, step: str) -> dict[str, object]:
    expires = timezone.now() + timedelta(days=3)
    return {
        "step": step,
        "reason": "quarter-end push",
        "input_tokens": "0",
        "output_tokens": "0",
        "concurrency": "0",
        "spend": spend,
        "expires_at": f"{expires:%Y-%m-%dT%H:%M}",
    }


@pytest.mark.django_db
def test_a_temporary_spend_increase_is_shown_apart_and_a_limit_edit_changes_the_base_only(users, cat):
    account = tenant(cat)
    CapacityAccount.objects.filter(pk=account.pk).update(spend_limit=5_000_000_000)
    finance = login("finance")
    url = reverse("admin:ledger_capacityaccount_increase", args=[account.pk])
    assert "Extra spend per period (USD)" in finance.get(url).content.decode()
    confirm = finance.post(url, increase_form("250.00", "edit")).content.decode()
    assert "spend limit (USD)" in confirm and "$5,000.00" in confirm and "$5,250.00" in confirm
    assert finance.post(url, increase_form("250.00", "confirm")).status_code == 302
    account.refresh_from_db()
    assert account.spend_limit == 5_250_000_000  # what admission reads: base + temporary
    increase = TemporaryIncrease.objects.get(account=account)
    assert (increase.spend, increase.input_tokens) == (250_000_000, 0)
    granted = ChangeRecord.objects.get(action="account.temporary_increase")
    assert (granted.before["spend_limit"], granted.after["spend_limit"]) == (5_000_000_000, 5_250_000_000)

    page = finance.get(reverse("admin:ledger_capacityaccount_change", args=[account.pk])).content.decode()
    assert "$5,250.00" in page and "$5,000.00 permanent +$250.00 temporary" in page
    assert "+$250.00" in finance.get(reverse("admin:budgeting_temporaryincrease_changelist")).content.decode()
    # The limits form offers the base, not base and increase folded into one figure.
    edit = finance.get(limits_url(account)).content.decode()
    assert spend_box(edit) == "5,000.00" and "+$250.00" in edit

    assert finance.post(limits_url(account), form(account, "confirm", "6,000")).status_code == 302
    assert tenant(cat).spend_limit == 6_250_000_000
    record = ChangeRecord.objects.get(action="account.limits")
    assert record.before["permanent"]["spend_limit"] == 5_000_000_000
    assert record.after["permanent"]["spend_limit"] == 6_000_000_000
    assert record.after["temporaryIncreases"] == {"spend": 250_000_000}
    assert limits.end_temporary_increase(
        increase_id=increase.pk, reason="expired", actor=FINANCE, now=timezone.now()
    )
    assert tenant(cat).spend_limit == 6_000_000_000  # finance's edit stays when the increase ends


@pytest.mark.django_db
def test_a_spend_increase_needs_a_spend_limit_and_an_amount(users, cat):
    account = tenant(cat)
    finance = login("finance")
    url = reverse("admin:ledger_capacityaccount_increase", args=[account.pk])
    warned = finance.post(url, increase_form("100", "edit")).content.decode()
    assert "spend limit (USD) is unlimited: there is nothing to increase." in warned
    refused = finance.post(url, increase_form("100", "confirm"), follow=True).content.decode()
    assert "spend is unlimited on this account; nothing to increase" in refused
    bad = finance.post(url, increase_form("-100", "confirm")).content.decode()
    assert "An amount cannot be negative." in bad
    assert not TemporaryIncrease.objects.exists() and tenant(cat).spend_limit is None
    assert login("analyst").post(url, increase_form("100", "confirm")).status_code == 403


def priced(cat: Catalog) -> FrozenPrice:
    """$3 input and $15 output per million tokens: 1,000 input and 200 output tokens hold $0.006."""
    price = Price.objects.create(
        model_revision=cat.model,
        effective_from=datetime(2026, 1, 1, tzinfo=UTC),
        currency="USD",
        input_per_million=Decimal("3"),
        output_per_million=Decimal("15"),
    )
    return FrozenPrice.of(price)


@pytest.mark.django_db(transaction=True)
def test_the_hold_reads_a_temporary_spend_increase_until_it_ends():
    cat = catalog(tenant_slug="t-inc")
    price = priced(cat)
    account = tenant_account(cat, spend_limit=6_000)

    def hold() -> None:
        admit(dataclasses.replace(spec(cat, input_tokens=1000, output_tokens=200), price=price))

    hold()
    with pytest.raises(QuotaExceeded) as refused:
        hold()
    assert refused.value.extra["dimension"] == "spend"
    start = timezone.now()
    increase = limits.grant_temporary_increase(
        account_id=account.pk,
        input_tokens=0,
        output_tokens=0,
        concurrency=0,
        spend=6_000,
        expires_at=start + timedelta(hours=1),
        reason="launch",
        actor=FINANCE,
        now=start,
    )
    hold()
    assert limits.expire_temporary_increases(now=start + timedelta(hours=1)) == 1
    account.refresh_from_db()
    assert account.spend_limit == 6_000 and TemporaryIncrease.objects.get(pk=increase.pk).ended_at
    with pytest.raises(QuotaExceeded):
        hold()
