"""How a capacity account's figures are shown: what is available, usage bars, the per-dimension table and the
rows and warnings of a limit change's preview (numbers written by ``formats``)."""

from __future__ import annotations

from dataclasses import dataclass

from django.utils.html import format_html
from django.utils.safestring import SafeString

from budgeting.backoffice.formats import count, signed
from budgeting.backoffice.kit import Row
from ledger.models import CapacityAccount
from ledger.services.limits import DimensionPreview

WARN_AT = 0.8


def available_figure(limit: int | None, used: int) -> SafeString:
    """What is left for new requests; negative (over the limit) in red."""
    if limit is None:
        return format_html("{}", count(None))
    left = limit - used
    if left < 0:
        return format_html('<span class="tb-neg" title="over the limit">{}</span>', count(left))
    return format_html("{}", count(left))


def _share(used: int, limit: int | None) -> float | None:
    if limit is None:
        return None
    return 1.0 if limit == 0 else used / limit


def usage_bar(label: str, used: int, limit: int | None) -> SafeString:
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
        count(used),
        count(limit),
        f"{min(share, 1.0) * 100:.1f}",
        label,
        f"{share * 100:.0f}",
    )


@dataclass(frozen=True)
class Dimension:
    """One row of an account's table: input, output or concurrency."""

    name: str
    limit: int | None
    reserved: int
    consumed: int
    used: int
    bar: SafeString
    # What active temporary increases add to ``limit`` (the limit in force); the rest is permanent.
    increase: int = 0

    @property
    def permanent(self) -> int | None:
        return None if self.limit is None else self.limit - self.increase

    @property
    def permanent_text(self) -> str:
        return count(self.permanent)

    @property
    def increase_text(self) -> str:
        return signed(self.increase)

    @property
    def available(self) -> SafeString:
        return available_figure(self.limit, self.used)

    @property
    def limit_text(self) -> str:
        return count(self.limit)

    @property
    def reserved_text(self) -> str:
        return count(self.reserved)

    @property
    def consumed_text(self) -> str:
        return count(self.consumed)

    @property
    def used_text(self) -> str:
        return count(self.used)


def dimensions(account: CapacityAccount, increases: dict[str, int] | None = None) -> list[Dimension]:
    """The account's three dimensions; concurrency's reserved is what is in flight, and it consumes none.
    ``increases`` (``limits.active_increases``) splits each limit into permanent and temporary."""
    extra = increases or {}
    balances = [
        ("input", account.input_limit, account.input_reserved, account.input_consumed),
        ("output", account.output_limit, account.output_reserved, account.output_consumed),
        ("concurrency", account.concurrency_limit, account.in_flight, 0),
    ]
    return [
        Dimension(
            name,
            limit,
            reserved,
            consumed,
            reserved + consumed,
            usage_bar(name, reserved + consumed, limit),
            extra.get(name, 0) if limit is not None else 0,
        )
        for name, limit, reserved, consumed in balances
    ]


def limit_rows(dims: list[DimensionPreview]) -> list[Row]:
    """The confirmation rows of a limit edit; with a temporary increase, the permanent limit (what the edit
    changes), the increase (unchanged) and the limit in force apart."""
    rows: list[Row] = []
    for d in dims:
        if d.increase:
            rows += [
                (f"{d.name} permanent limit", count(d.old_permanent), count(d.new_permanent), False),
                (f"{d.name} temporary increase (unchanged)", signed(d.increase), signed(d.increase), False),
                (f"{d.name} limit in force", count(d.old_limit), count(d.new_limit), False),
            ]
        else:
            rows.append((f"{d.name} limit", count(d.old_limit), count(d.new_limit), False))
        rows.append(
            (
                f"{d.name} available (in use {count(d.used)})",
                count(d.old_available),
                count(d.new_available),
                d.below_use,
            )
        )
    return rows


def limit_warnings(dims: list[DimensionPreview]) -> list[str]:
    return [
        f"The new {d.name} limit ({count(d.new_limit)}) is below current use ({count(d.used)}): new requests "
        "will be refused on this account until usage falls or the period rolls over."
        for d in dims
        if d.below_use and d.changed and d.new_limit is not None
    ]
