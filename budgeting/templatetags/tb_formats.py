"""The admin's number and money formats (``budgeting.backoffice.formats``) as template filters:
``{% load tb_formats %}`` then ``{{ n|count }}``, ``{{ delta|signed }}``, ``{{ amount|money:currency }}``,
``{{ price|unit_price:currency }}``, ``{{ by_currency|amounts }}``, ``{{ share|percent }}``."""

from __future__ import annotations

from django import template

from budgeting.backoffice import formats

register = template.Library()

for _name in ("count", "signed", "compact", "money", "unit_price", "amounts", "percent"):
    register.filter(_name, getattr(formats, _name))
