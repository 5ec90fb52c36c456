"""How the admin writes the figures people read, and reads the ones they type: token counts with thousands
separators ("2,000,000"), signed movements ("+2,000,000", "-1,600"), money at its currency's precision with
its symbol ("$2.36"), and unit prices (per 1M tokens) with the digits they have.

Templates use the same functions as filters (``{% load tb_formats %}``); a form field reading a count
(``CountField``) accepts what it shows ("12,000,000"), and one reading money (``MoneyField``) an amount of its
currency as finance writes it ("5,000.00"), exactly as a ``Decimal``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

from django import forms
from django.core.exceptions import ValidationError
from django.utils.html import format_html
from django.utils.safestring import SafeString

UNLIMITED = "∞"
# Costs are computed and kept to the micro-unit (reports.pricing.COST_QUANTUM): never show more decimals.
MAX_MONEY_PLACES = 6

# Symbols people expect in front of an amount; other currencies are written after it ("2.36 CHF").
CURRENCY_SYMBOLS = {"USD": "$", "EUR": "€", "GBP": "£", "JPY": "¥", "INR": "₹", "KRW": "₩"}

# ISO 4217 minor units of the currencies that do not have two (the rest have two).
MINOR_UNITS = {
    "BHD": 3,
    "CLP": 0,
    "IQD": 3,
    "ISK": 0,
    "JOD": 3,
    "JPY": 0,
    "KRW": 0,
    "KWD": 3,
    "LYD": 3,
    "OMR": 3,
    "PYG": 0,
    "TND": 3,
    "UGX": 0,
    "VND": 0,
    "XAF": 0,
    "XOF": 0,
}

# Separators a person may type inside a number: commas, spaces (also the narrow no-break ones), underscores.
_SEPARATORS = re.compile(r"[,_\s\u00a0\u202f]")
_INTEGER = re.compile(r"[+-]?[0-9]+")
_AMOUNT = re.compile(r"[0-9]+(\.[0-9]*)?|\.[0-9]+")
# The largest amount a BIGINT column holds in micro-units.
MAX_MONEY = Decimal(2**63 - 1).scaleb(-MAX_MONEY_PLACES)


def count(value: int | None) -> str:
    """A count of tokens or requests with thousands separators; no value (no limit) is "∞"."""
    return UNLIMITED if value is None else f"{value:,}"


def signed(value: int | None) -> str:
    """A movement with its sign: "+2,000,000", "-1,600", "0"; no value is "—"."""
    if value is None:
        return "—"
    return f"{value:+,}" if value else "0"


def minor_units(currency: str) -> int:
    return MINOR_UNITS.get(currency.upper(), 2)


def money(amount: Decimal | int | str | None, currency: str | None, places: int | None = None) -> str:
    """An amount rounded (half up) to its currency's precision, or to ``places`` decimals, with its symbol:
    "$2.36", "-€1,204.50", "¥236", "2.36 CHF". An amount that is not zero but rounds to zero is "< $0.01"
    (never "$0.00" beside a total that is not). No amount is "—"."""
    if amount is None or not currency:
        return "—"
    places = minor_units(currency) if places is None else places
    value = Decimal(amount)
    rounded = _round(value, places)
    if not rounded and value:
        smallest = _with_currency(f"{Decimal(1).scaleb(-places):.{places}f}", currency, negative=False)
        return f"< {smallest}" if value > 0 else f"> -{smallest}"
    return _with_currency(f"{abs(rounded):,.{places}f}", currency, negative=rounded < 0)


def _round(value: Decimal, places: int) -> Decimal:
    return value.quantize(Decimal(1).scaleb(-places), rounding=ROUND_HALF_UP)


def money_places(column: Iterable[dict[str, Decimal]], total: dict[str, Decimal]) -> dict[str, int]:
    """Per currency, the fewest decimals (from its minor units up to the micro-unit costs are kept in) at
    which a column of amounts shows every amount that is not zero as not zero and its rounded rows add up to
    its rounded total: sub-cent rows read "$0.0042", not "$0.00" under a total of "$0.01"."""
    rows = list(column)
    places: dict[str, int] = {}
    for currency, whole in total.items():
        amounts = [row[currency] for row in rows if row.get(currency)]
        chosen = minor_units(currency)
        while chosen < MAX_MONEY_PLACES and (
            any(not _round(a, chosen) for a in amounts)
            or sum((_round(a, chosen) for a in amounts), Decimal(0)) != _round(whole, chosen)
        ):
            chosen += 1
        places[currency] = chosen
    return places


def unit_price(amount: Decimal | str | None, currency: str | None) -> str:
    """A price per million tokens: at least the currency's precision, more digits when the price has them
    ("$0.27", "$0.0375"). Where it is shown, the column or label says "per 1M tokens"."""
    if amount is None or not currency:
        return "—"
    value = Decimal(amount)
    return _with_currency(amount_digits(abs(value), currency), currency, negative=value < 0)


def micro_money(micro: int | None, currency: str) -> str:
    """Micro-units of ``currency`` (the ledger's money) as finance reads them, exactly: "$5,000.00",
    "$0.000125"; none (no limit) is "∞"."""
    return UNLIMITED if micro is None else unit_price(Decimal(micro).scaleb(-MAX_MONEY_PLACES), currency)


def signed_micro_money(micro: int | None, currency: str) -> str:
    """A movement of micro-units with its sign: "+$500.00", "-$1.20", "0"; none is "—"."""
    if micro is None:
        return "—"
    if not micro:
        return "0"
    return ("+" if micro > 0 else "") + micro_money(micro, currency)


def amount_digits(value: Decimal, currency: str) -> str:
    """An amount's digits with separators, at least at its currency's precision and with every further digit
    it has ("5,000.00", "0.0375"): nothing rounded away."""
    exponent = value.normalize().as_tuple().exponent
    places = max(minor_units(currency), -exponent if isinstance(exponent, int) else 0)
    return f"{value:,.{places}f}"


def _with_currency(digits: str, currency: str, *, negative: bool) -> str:
    symbol = CURRENCY_SYMBOLS.get(currency.upper())
    text = f"{symbol}{digits}" if symbol else f"{digits} {currency.upper()}"
    return f"-{text}" if negative else text


def amounts(by_currency: dict[str, Decimal], places: dict[str, int] | None = None) -> str:
    """Amounts in several currencies, largest first: "$2.36 + €0.40" (each at its ``places`` when given,
    see ``money_places``); none is "—"."""
    if not by_currency:
        return "—"
    ordered = sorted(by_currency.items(), key=lambda item: (-item[1], item[0]))
    chosen = places or {}
    return " + ".join(money(amount, currency, chosen.get(currency)) for currency, amount in ordered)


def percent(share: float | None, places: int = 0) -> str:
    """A share of 1 as a percentage ("82 %"); none is "—"."""
    return "—" if share is None else f"{share * 100:,.{places}f} %"


def parse_count(text: str) -> int:
    """A count typed by a person: "12,000,000", "12 000 000", "+1,600", "-1,600". Raises ValueError."""
    cleaned = _SEPARATORS.sub("", text)
    if not _INTEGER.fullmatch(cleaned):
        raise ValueError(text)
    return int(cleaned)


def parse_money(text: str, currency: str) -> Decimal:
    """A non-negative amount of ``currency`` typed by a person: "5,000.00", "5 000", "0.25", "$5,000" (its
    symbol is optional), exactly as written. Raises ValueError for anything else, a sign or another
    currency's symbol included."""
    cleaned = _SEPARATORS.sub("", text)
    symbol = CURRENCY_SYMBOLS.get(currency.upper())
    if symbol:
        cleaned = cleaned.removeprefix(symbol)
    if not _AMOUNT.fullmatch(cleaned):
        raise ValueError(text)
    return Decimal(cleaned)


class CountInput(forms.TextInput):
    """A text box for counts: shows its value with separators and asks phones for the numeric keypad."""

    def __init__(self, attrs: dict[str, Any] | None = None) -> None:
        super().__init__(
            {"inputmode": "numeric", "autocomplete": "off", "class": "tb-count", **(attrs or {})}
        )

    def format_value(self, value: Any) -> str | None:
        if isinstance(value, int) and not isinstance(value, bool):
            return count(value)
        return super().format_value(value)


class CountField(forms.IntegerField):
    """An integer count of tokens or requests, typed with or without thousands separators."""

    widget = CountInput
    default_error_messages = {"invalid": "Enter a whole number, e.g. 12,000,000."}

    def to_python(self, value: Any) -> int | None:
        if value in self.empty_values:
            return None
        if isinstance(value, int):
            return value
        try:
            return parse_count(str(value))
        except ValueError:
            raise ValidationError(self.error_messages["invalid"], code="invalid") from None

    def widget_attrs(self, widget: forms.Widget) -> dict[str, Any]:
        # IntegerField would add min/max/step attributes that only a number input understands.
        return {}


class MoneyField(forms.Field):
    """A non-negative amount of ``currency``, typed with or without thousands separators, read exactly as a
    ``Decimal`` (never a float) with at most micro-unit precision: the amount money columns keep in integer
    micro-units. Empty is None. Shown as finance reads it ("5,000.00"), without the symbol."""

    default_error_messages = {
        "invalid": "Enter an amount, e.g. 5,000.00.",
        "negative": "An amount cannot be negative.",
        "precision": f"At most {MAX_MONEY_PLACES} decimal places (a micro-unit of %(currency)s).",
        "too_large": "The amount is too large.",
    }

    def __init__(self, *, currency: str, **kwargs: Any) -> None:
        self.currency = currency
        kwargs.setdefault(
            "widget",
            forms.TextInput(attrs={"inputmode": "decimal", "autocomplete": "off", "class": "tb-count"}),
        )
        super().__init__(**kwargs)

    def to_python(self, value: Any) -> Decimal | None:
        if value in self.empty_values:
            return None
        if isinstance(value, Decimal):
            amount = value
        else:
            text = str(value).strip()
            if text.startswith("-"):
                raise ValidationError(self.error_messages["negative"], code="negative")
            try:
                amount = parse_money(text, self.currency)
            except ValueError:
                raise ValidationError(self.error_messages["invalid"], code="invalid") from None
        if amount < 0:
            raise ValidationError(self.error_messages["negative"], code="negative")
        # Checked first: a quantize beyond the context's 28 digits would raise.
        if amount > MAX_MONEY:
            raise ValidationError(self.error_messages["too_large"], code="too_large")
        if amount != amount.quantize(Decimal(1).scaleb(-MAX_MONEY_PLACES), rounding=ROUND_HALF_UP):
            raise ValidationError(
                self.error_messages["precision"], code="precision", params={"currency": self.currency}
            )
        return amount

    def prepare_value(self, value: Any) -> Any:
        if isinstance(value, Decimal):
            return amount_digits(value, self.currency)
        return value


def revision_name(name: str) -> SafeString:
    """A model revision's name (``model@date``) that a narrow column breaks only after its ``@``: the model
    and the date each stay on one line."""
    model, at, date = name.rpartition("@")
    if not at:
        return format_html('<span class="tb-nobreak">{}</span>', name)
    return format_html(
        '<span class="tb-nobreak">{}@</span><wbr><span class="tb-nobreak">{}</span>', model, date
    )
