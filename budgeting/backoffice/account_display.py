"""How a capacity account's figures are shown: what is available, usage bars, the per-dimension table and the
rows and warnings of a limit change's preview (numbers written by ``formats``; spend, kept in micro-units, as
an exact amount of the account's currency)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from django.utils.html import format_html
from django.utils.safestring import SafeString

from budgeting.backoffice.formats import (
    CURRENCY_SYMBOLS,
    count,
    micro_money,
    minor_units,
    signed,
    signed_micro_money,
)
from budgeting.backoffice.kit import Row
from ledger.models import CapacityAccount
from ledger.services.limits import DimensionPreview

WARN_AT = 0.8
Show = Callable[[int | None], str]


def shown_as(name: str, currency: str) -> Show:
    """How a dimension's figures are written: counts, or spend's micro-units as money."""
    if name == "spend":
        return lambda value: micro_money(value, currency)
    return count


def available_figure(limit: int | None, used: int, show: Show = count) -> SafeString:
    """What is left for new requests; negative (over the limit) in red."""
    if limit is None:
        return format_html("{}", show(None))
    left = limit - used
    if left < 0:
        return format_html('<span class="tb-neg" title="over the limit">{}</span>', show(left))
    return format_html("{}", show(left))


def _share(used: int, limit: int | None) -> float | None:
    if limit is None:
        return None
    return 1.0 if limit == 0 else used / limit


def usage_bar(label: str, used: int, limit: int | None, show: Show = count) -> SafeString:
    """A thin horizontal bar of used/limit, amber from 80 %, red at or over the limit."""
    share = _share(used, limit)
    if share is None:
        return format_html('<div class="tb-bar tb-bar-none" title="unlimited">{} ∞</div>', label)
    level = "over" if share >= 1 else "warn" if share >= WARN_AT else "ok"
    return format_html(
        '<div class="tb-bar tb-bar-{}" title="{}: {} of {}">'
        '<span style="width:{}%"></span><em>{} {}%</em></div>',
        level,
        label,
        show(used),
        show(limit),
        f"{min(share, 1.0) * 100:.1f}",
        label,
        f"{share * 100:.0f}",
    )


@dataclass(frozen=True)
class Dimension:
    """One row of an account's table: input, output, concurrency or spend (in micro-units of ``currency``,
    shown as money)."""

    name: str
    limit: int | None
    reserved: int
    consumed: int
    used: int
    bar: SafeString
    # What active temporary increases add to ``limit`` (the limit in force); the rest is permanent.
    increase: int = 0
    currency: str = ""

    @property
    def is_money(self) -> bool:
        return self.name == "spend"

    @property
    def symbol(self) -> str:
        """What the live preview writes before an amount (the symbol), or after it (the code)."""
        return CURRENCY_SYMBOLS.get(self.currency, "")

    @property
    def places(self) -> int:
        return minor_units(self.currency)

    def _show(self, value: int | None) -> str:
        return shown_as(self.name, self.currency)(value)

    @property
    def permanent(self) -> int | None:
        return None if self.limit is None else self.limit - self.increase

    @property
    def permanent_text(self) -> str:
        return self._show(self.permanent)

    @property
    def increase_text(self) -> str:
        return signed_micro_money(self.increase, self.currency) if self.is_money else signed(self.increase)

    @property
    def available(self) -> SafeString:
        return available_figure(self.limit, self.used, self._show)

    @property
    def limit_text(self) -> str:
        return self._show(self.limit)

    @property
    def reserved_text(self) -> str:
        return self._show(self.reserved)

    @property
    def consumed_text(self) -> str:
        return self._show(self.consumed)

    @property
    def used_text(self) -> str:
        return self._show(self.used)


def dimensions(account: CapacityAccount, increases: dict[str, int] | None = None) -> list[Dimension]:
    """The account's four dimensions; concurrency's reserved is what is in flight, and it consumes none;
    spend is held and posted money. ``increases`` (``limits.active_increases``) splits each limit into
    permanent and temporary."""
    extra = increases or {}
    balances = [
        ("input", account.input_limit, account.input_reserved, account.input_consumed),
        ("output", account.output_limit, account.output_reserved, account.output_consumed),
        ("concurrency", account.concurrency_limit, account.in_flight, 0),
        ("spend", account.spend_limit, account.spend_reserved, account.spend_consumed),
    ]
    return [
        Dimension(
            name,
            limit,
            reserved,
            consumed,
            reserved + consumed,
            usage_bar(name, reserved + consumed, limit, shown_as(name, account.currency)),
            extra.get(name, 0) if limit is not None else 0,
            account.currency,
        )
        for name, limit, reserved, consumed in balances
    ]


def limit_rows(dims: list[DimensionPreview], currency: str) -> list[Row]:
    """The confirmation rows of a limit edit; with a temporary increase, the permanent limit (what the edit
    changes), the increase (unchanged) and the limit in force apart. Spend is money of ``currency``."""
    rows: list[Row] = []
    for d in dims:
        show = shown_as(d.name, currency)
        name = f"spend ({currency})" if d.name == "spend" else d.name
        if d.increase:
            more = signed_micro_money(d.increase, currency) if d.name == "spend" else signed(d.increase)
            rows += [
                (f"{name} permanent limit", show(d.old_permanent), show(d.new_permanent), False),
                (f"{name} temporary increase (unchanged)", more, more, False),
                (f"{name} limit in force", show(d.old_limit), show(d.new_limit), False),
            ]
        else:
            rows.append((f"{name} limit", show(d.old_limit), show(d.new_limit), False))
        rows.append(
            (
                f"{name} available (in use {show(d.used)})",
                show(d.old_available),
                show(d.new_available),
                d.below_use,
            )
        )
    return rows


def limit_warnings(dims: list[DimensionPreview], currency: str) -> list[str]:
    return [
        f"The new {d.name} limit ({shown_as(d.name, currency)(d.new_limit)}) is below current use "
        f"({shown_as(d.name, currency)(d.used)}): new requests will be refused on this account until usage "
        "falls or the period rolls over."
        for d in dims
        if d.below_use and d.changed and d.new_limit is not None
    ]
