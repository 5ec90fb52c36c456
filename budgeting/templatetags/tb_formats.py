"""The admin's number and money formats (``budgeting.backoffice.formats``) as template filters:
``{% load tb_formats %}`` then ``{{ n|count }}``, ``{{ delta|signed }}``, ``{{ amount|money:currency }}``,
``{{ price|unit_price:currency }}``, ``{{ micro|micro_money:currency }}`` and
``{{ micro|signed_micro_money:currency }}`` (the ledger's micro-units), ``{{ by_currency|amounts }}``
(``{{ by_currency|amounts:places }}`` at a column's decimals), ``{{ share|percent }}``, and
``{% money_in amount currency places %}``."""

from __future__ import annotations

from decimal import Decimal

from django import template

from budgeting.backoffice import formats

register = template.Library()

for _name in (
    "count",
    "signed",
    "money",
    "unit_price",
    "micro_money",
    "signed_micro_money",
    "amounts",
    "percent",
):
    register.filter(_name, getattr(formats, _name))


@register.simple_tag
def money_in(amount: Decimal | None, currency: str | None, places: dict[str, int] | None) -> str:
    """``{% money_in amount currency places %}``: an amount of a column at the column's decimals
    (``formats.money_places``)."""
    return formats.money(amount, currency, (places or {}).get(currency or ""))
