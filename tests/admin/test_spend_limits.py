"""Finance sets an account's spend limit in the admin (issue 19 §1): an amount of the account's
currency typed as finance writes it, kept in micro-units, through the one limits edit (a reason, the change
log, the check that the limits are those the person saw); refused with a form error when it is not an
amount, and the next admission holds against it (429 naming the spend dimension)."""

from __future__ import annotations

import re
from decimal import Decimal

import pytest
from django.contrib.messages import get_messages
from django.urls import reverse

from budgeting.catalog.changes import Actor
from budgeting.catalog.models import ChangeRecord
from budgeting.catalog.prices import cost, from_micro
from ledger.models import CapacityAccount, Scope
from ledger.services import limits
from tests.admin.conftest import login
from tests.api.test_money_end_to_end import IN_PRICE, OUT_PRICE, admit

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
    first = admit(demo_api, "spend-admin-1")
    assert first.status_code == 201, first.content[:300]
    tokens = first.json()["tokens"]
    hold = cost(tokens["input"], IN_PRICE) + cost(tokens["maxOutput"], OUT_PRICE)
    account.refresh_from_db()
    used = account.spend_reserved + account.spend_consumed
    assert used == hold

    # One micro-dollar short of a second hold.
    limit = used + hold - 1
    finance = login("finance")
    typed = f"{from_micro(limit):f}"
    assert finance.post(limits_url(account), form(account, "confirm", typed)).status_code == 302
    assert CapacityAccount.objects.get(pk=account.pk).spend_limit == limit

    refused = admit(demo_api, "spend-admin-2")
    assert refused.status_code == 429, refused.content[:300]
    problem = refused.json()
    assert (problem["code"], problem["dimension"], problem["currency"]) == ("QUOTA_EXCEEDED", "spend", "USD")
    assert (problem["requested"], problem["available"]) == (hold, hold - 1)

    account.refresh_from_db()
    raised = Decimal(typed) + Decimal("0.000001")
    assert finance.post(limits_url(account), form(account, "confirm", f"{raised:f}")).status_code == 302
    assert admit(demo_api, "spend-admin-3").status_code == 201
