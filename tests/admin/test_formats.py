"""The admin's one formatting helper: counts with separators, signed movements, money at its currency's
precision with its symbol, unit prices with their digits, and counts typed with separators."""

from __future__ import annotations

import re
from decimal import Decimal

import pytest
from django.core.exceptions import ValidationError
from django.template import Context, Template

from budgeting.backoffice.formats import (
    CountField,
    amounts,
    count,
    money,
    parse_count,
    percent,
    signed,
    unit_price,
)


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
