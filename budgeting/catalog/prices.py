"""Prices as admission freezes them, the money arithmetic of holds and postings, and the one write path of a
new price.

Money is stored in integer micro-units of its currency (1 USD = 1,000,000): ``BIGINT`` columns, ``int`` in
Python, ``Decimal`` only where a person reads or types it. A price per million tokens is kept by the catalog
as exact ``NUMERIC(14, 6)``, so in micro-units per million tokens it is an integer. The cost of ``n`` tokens
is ``ceil(n × price / 1,000,000)`` micro-units: never below the provider's figure, and monotonic, so what is
posted never exceeds what was held for the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal

from django.db import transaction

from budgeting.catalog.changes import Actor, record_change, require_reason, snapshot
from budgeting.catalog.errors import InvalidChange
from budgeting.catalog.models import ModelRevision, Price

MICRO = 1_000_000
"""Micro-units per unit of a currency; also tokens per million."""


def to_micro(amount: Decimal) -> int:
    """A money amount (or a price per million tokens) in micro-units. Raises InvalidChange for a fraction
    of a micro-unit."""
    micro = amount * MICRO
    if micro != micro.to_integral_value():
        raise InvalidChange(f"{amount} has more than 6 decimal places")
    return int(micro)


def from_micro(micro: int) -> Decimal:
    """Micro-units as a ``Decimal`` amount of the currency, exactly (6 decimal places)."""
    return (Decimal(micro) / MICRO).quantize(Decimal("0.000001"))


def cost(tokens: int, per_million: int) -> int:
    """The cost of ``tokens`` at ``per_million`` micro-units per million tokens, rounded up."""
    return -(-tokens * per_million // MICRO)


@dataclass(frozen=True)
class FrozenPrice:
    """The prices an admission used, in micro-units per million tokens of ``currency``."""

    price_id: int
    currency: str
    input: int
    cached_input: int
    output: int

    @classmethod
    def of(cls, price: Price) -> FrozenPrice:
        cached = price.cached_input_per_million
        return cls(
            price_id=price.pk,
            currency=price.currency,
            input=to_micro(price.input_per_million),
            cached_input=to_micro(price.input_per_million if cached is None else cached),
            output=to_micro(price.output_per_million),
        )

    def hold(self, input_tokens: int, output_tokens: int) -> int:
        """The money held for this many input and output tokens."""
        return cost(input_tokens, self.input) + cost(output_tokens, self.output)


FrozenPriceAt = tuple[datetime, "FrozenPrice"]
"""A price version and its start."""


def price_in_force(prices: list[FrozenPriceAt], at: datetime) -> FrozenPrice | None:
    """The price whose period contains ``at``: the latest start at or before it (``prices`` by start)."""
    chosen = None
    for start, price in prices:
        if start > at:
            break
        chosen = price
    return chosen


def price_at(model_revision: ModelRevision, at: datetime) -> FrozenPrice | None:
    """The model revision's price in force at ``at``, from the database (admission reads the snapshot)."""
    price = (
        Price.objects.filter(model_revision=model_revision, effective_from__lte=at)
        .order_by("-effective_from")
        .first()
    )
    return None if price is None else FrozenPrice.of(price)


def add_price(
    *,
    model_revision: ModelRevision,
    currency: str,
    input_per_million: Decimal,
    output_per_million: Decimal,
    cached_input_per_million: Decimal | None,
    effective_from: datetime,
    note: str,
    actor: Actor,
    reason: str,
    now: datetime,
) -> Price:
    """A new price version of a model revision, effective from ``effective_from`` (``now`` or later), with
    its change-log entry, in one transaction (joined when the caller has one: the admin saves inside its
    own). Prices are never edited: a correction is a new version from now on.

    Raises InvalidChange for a start in the past, a missing reason or an amount finer than a micro-unit.
    """
    reason = require_reason(reason)
    if effective_from < now:
        raise InvalidChange(
            "a price cannot start in the past: it would re-price admissions already made; "
            "a correction is a new price from now on"
        )
    for amount in (input_per_million, output_per_million, cached_input_per_million):
        if amount is not None:
            if amount < 0:
                raise InvalidChange("a price cannot be negative")
            to_micro(amount)
    with transaction.atomic():
        price = Price.objects.create(
            model_revision=model_revision,
            currency=currency,
            input_per_million=input_per_million,
            output_per_million=output_per_million,
            cached_input_per_million=cached_input_per_million,
            effective_from=effective_from,
            note=note,
        )
        record_change(
            actor=actor, action="price.add", target=price, before=None, after=snapshot(price), reason=reason
        )
    return price
