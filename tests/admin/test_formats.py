"""The admin's one formatting helper: counts with separators, signed movements, money at its currency's
precision with its symbol, unit prices with their digits, and counts typed with separators."""

from __future__ import annotations

import re
from decimal import Decimal

import pytest
from django.core.exceptions import ValidationError
from django.template import Context, Template
from hypothesis import given
from hypothesis import strategies as st

from budgeting.backoffice.formats import (
    CountField,
    MoneyField,
    amounts,
    count,
    micro_money,
    money,
    parse_count,
    percent,
    signed,
    signed_micro_money,
    unit_price,
)
from budgeting.catalog.prices import from_micro, to_micro


def test_counts_and_movements_carry_thousands_separators():
    assert count(2_000_000) == "2,000,000"
    assert count(None) == "∞"
    assert signed(2_000_000) == "+2,000,000"
    assert signed(-1600) == "-1,600"
    assert signed(0) == "0"
    assert percent(0.825) == "82 %"


@pytest.mark.parametrize(
    ("amount", "currency", "shown"),
    [
        (Decimal("2.356566"), "USD", "$2.36"),
        (Decimal("0.005"), "USD", "$0.01"),
        (Decimal("-1204.5"), "EUR", "-€1,204.50"),
        (Decimal("236.4"), "JPY", "¥236"),
        (Decimal("1.2345"), "KWD", "1.235 KWD"),
        (Decimal("2.356"), "CHF", "2.36 CHF"),
        ("0.019680", "USD", "$0.02"),
        (None, "USD", "—"),
    ],
)
def test_money_is_rounded_to_its_currency_with_its_symbol(amount, currency, shown):
    assert money(amount, currency) == shown


def test_unit_prices_keep_their_digits_and_amounts_add_up_per_currency():
    assert unit_price(Decimal("0.270000"), "USD") == "$0.27"
    assert unit_price(Decimal("0.037500"), "USD") == "$0.0375"
    assert unit_price(Decimal("3"), "USD") == "$3.00"
    assert amounts({"USD": Decimal("2.356"), "EUR": Decimal("0.4")}) == "$2.36 + €0.40"
    assert amounts({}) == "—"


@pytest.mark.parametrize(
    ("typed", "value"),
    [("12,000,000", 12_000_000), ("12 000 000", 12_000_000), ("+1,600", 1600), ("-1,600", -1600), ("7", 7)],
)
def test_counts_may_be_typed_with_separators(typed, value):
    assert parse_count(typed) == value
    assert CountField().clean(typed) == value


@pytest.mark.parametrize("typed", ["1.5", "12,000,000 tokens", "1e6", "--3"])
def test_a_count_that_is_not_a_whole_number_is_refused_in_words(typed):
    field = CountField()
    with pytest.raises(ValidationError, match=re.escape("Enter a whole number, e.g. 12,000,000.")):
        field.clean(typed)


def test_the_count_input_shows_its_value_back_with_separators():
    html = CountField().widget.render("input_limit", 12_000_000)
    assert 'value="12,000,000"' in html and 'inputmode="numeric"' in html


def test_templates_use_the_same_helper():
    html = Template(
        "{% load tb_formats %}{{ n|count }} {{ d|signed }} {{ a|money:'USD' }} {{ p|unit_price:'USD' }}"
    ).render(Context({"n": 1234567, "d": -1600, "a": Decimal("2.355"), "p": Decimal("0.0375")}))
    assert html == "1,234,567 -1,600 $2.36 $0.0375"


@pytest.mark.parametrize(
    ("typed", "currency", "value"),
    [
        ("5,000.00", "USD", Decimal("5000.00")),
        ("$5,000", "USD", Decimal("5000")),
        ("1 250.000125", "EUR", Decimal("1250.000125")),
        ("€0.5", "EUR", Decimal("0.5")),
        (".25", "USD", Decimal("0.25")),
        ("236", "JPY", Decimal("236")),
    ],
)
def test_money_may_be_typed_as_finance_writes_it(typed, currency, value):
    assert MoneyField(currency=currency).clean(typed) == value


def test_money_the_ledger_keeps_is_shown_exactly():
    assert micro_money(5_000_000_000, "USD") == "$5,000.00"
    assert micro_money(125, "USD") == "$0.000125"
    assert micro_money(None, "USD") == "∞"
    assert signed_micro_money(250_000_000, "EUR") == "+€250.00"
    assert signed_micro_money(-1_200_000, "USD") == "-$1.20"
    assert signed_micro_money(0, "USD") == "0"


@given(st.integers(min_value=0, max_value=2**63 - 1), st.sampled_from(["USD", "JPY", "KWD", "CHF"]))
def test_an_amount_shown_in_the_form_reads_back_to_the_same_micro_units(micro, currency):
    """What the form pre-fills (a limit in micro-units, shown as money) is what it reads when posted back:
    exact to the micro-unit, at any size a BIGINT holds, never through a float."""
    field = MoneyField(currency=currency)
    shown = field.prepare_value(from_micro(micro))
    assert to_micro(field.clean(shown)) == micro
