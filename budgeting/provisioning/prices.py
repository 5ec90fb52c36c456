"""The price table of a provisioning file: each price checked field by field and listed as an object the file
wants (one per model revision and start, as the ``Price`` model keeps them)."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from typing import Any

from django.db import models

from budgeting.catalog.models import Price
from budgeting.provisioning.source import ProvisioningError, Reader, items
from budgeting.provisioning.wanted import Wanted, fixed_point, wanted

CURRENCY = re.compile(r"[A-Z]{3}")


def read_prices(doc: dict[str, Any], revisions: set[Any]) -> list[Wanted]:
    """The prices a document sets, one per model revision and start; ``revisions`` are the model revisions
    that may be named. Raises ProvisioningError naming the first bad field."""
    out = []
    for path, item in items(doc, "prices"):
        r = Reader(
            item,
            path,
            {
                "modelRevision",
                "effectiveFrom",
                "currency",
                "inputPerMillion",
                "cachedInputPerMillion",
                "outputPerMillion",
                "note",
            },
        )
        revision = r.ref("modelRevision", revisions, "model revision")
        start = _instant(r, "effectiveFrom")
        currency = r.get("currency", str, "USD")
        if not CURRENCY.fullmatch(currency):
            raise ProvisioningError(
                f"{path}.currency", f"must be a three-letter ISO code, e.g. USD, got {currency!r}"
            )
        fields = [
            ("currency", "currency", currency),
            ("input_per_million", "inputPerMillion", _amount(r, "inputPerMillion", "input_per_million")),
            ("output_per_million", "outputPerMillion", _amount(r, "outputPerMillion", "output_per_million")),
            (
                "cached_input_per_million",
                "cachedInputPerMillion",
                None
                if r.data.get("cachedInputPerMillion") is None
                else _amount(r, "cachedInputPerMillion", "cached_input_per_million"),
            ),
            ("note", "note", r.get("note", str, "")),
        ]
        lookup = {"model_revision": revision, "effective_from": start}
        out.append(wanted("price", f"{revision} from {start:%Y-%m-%dT%H:%M:%SZ}", Price, lookup, fields))
    return out


def _instant(r: Reader, key: str) -> datetime:
    """A date and time with its time zone (ISO 8601 text, or a YAML timestamp), in UTC."""
    value = r.data.get(key)
    if value is None:
        raise ProvisioningError(f"{r.path}.{key}", "is required")
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            raise ProvisioningError(
                f"{r.path}.{key}",
                f"must be an ISO 8601 date and time, e.g. 2026-01-01T00:00:00Z, got {value!r}",
            ) from None
    if not isinstance(value, datetime):
        raise ProvisioningError(f"{r.path}.{key}", "must be a date and time, e.g. 2026-01-01T00:00:00Z")
    if value.tzinfo is None:
        raise ProvisioningError(f"{r.path}.{key}", "must name its time zone, e.g. 2026-01-01T00:00:00Z")
    return value.astimezone(UTC)


def _amount(r: Reader, key: str, name: str) -> str:
    """A price per million tokens, as fixed-point text at the model field's precision ("0.27" -> "0.270000").
    Quoted text is exact; a YAML number is read as it is written."""
    field = Price._meta.get_field(name)
    assert isinstance(field, models.DecimalField)
    value = r.get(key, object, required=True)
    amount = _decimal(value)
    if amount is None or not amount.is_finite() or amount < 0:
        raise ProvisioningError(
            f"{r.path}.{key}", f'must be a price of 0 or more, e.g. "0.27", got {value!r}'
        )
    text = fixed_point(amount, field)
    if Decimal(text) != amount:
        raise ProvisioningError(f"{r.path}.{key}", f"has more than {field.decimal_places} decimal places")
    if len(Decimal(text).as_tuple().digits) > (field.max_digits or 0):
        raise ProvisioningError(f"{r.path}.{key}", f"has more than {field.max_digits} digits")
    return text


def money_amount(r: Reader, key: str) -> Decimal:
    """An amount of money of 0 or more with at most 6 decimal places (quoted text is exact; a YAML number
    is read as it is written). Raises ProvisioningError naming the field."""
    value = r.get(key, object, required=True)
    amount = _decimal(value)
    if amount is None or not amount.is_finite() or amount < 0:
        raise ProvisioningError(
            f"{r.path}.{key}", f'must be an amount of 0 or more, e.g. "5000", got {value!r}'
        )
    if amount != amount.quantize(Decimal("0.000001")):
        raise ProvisioningError(f"{r.path}.{key}", "has more than 6 decimal places")
    return amount


def _decimal(value: object) -> Decimal | None:
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        return None
    try:
        return Decimal(str(value).strip())
    except InvalidOperation:
        return None
