"""How full each capacity account is against its limits and its alert thresholds, and the crossings that
follow from it: read in one pass for the Prometheus gauges and the beat task alike."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime

from django.db import transaction

from budgeting.observability.alerts.models import (
    DEFAULT_CRITICAL_PERCENT,
    DEFAULT_WARNING_PERCENT,
    AlertThresholds,
    Dimension,
    Severity,
    ThresholdCrossing,
)
from ledger.models import CapacityAccount


@dataclass(frozen=True)
class AccountUse:
    """One account's use of one dimension's limit in its current period."""

    account: CapacityAccount
    dimension: Dimension
    limit: int | None
    reserved: int
    consumed: int
    thresholds: tuple[tuple[Severity, int], ...]

    @property
    def used(self) -> int:
        """What admission counts against the limit: consumed plus reserved."""
        return self.consumed + self.reserved

    @property
    def ratio(self) -> float | None:
        """Use as a share of the limit (None without a limit; a zero limit is full from the start)."""
        if self.limit is None:
            return None
        return float("inf") if self.limit == 0 else self.used / self.limit

    def crossed(self) -> list[tuple[Severity, int]]:
        """The thresholds this use has reached."""
        if self.limit is None:
            return []
        return [
            (severity, percent)
            for severity, percent in self.thresholds
            if self.used * 100 >= percent * self.limit
        ]


def thresholds_of(row: AlertThresholds | None) -> tuple[tuple[Severity, int], ...]:
    if row is None:
        return ((Severity.WARNING, DEFAULT_WARNING_PERCENT), (Severity.CRITICAL, DEFAULT_CRITICAL_PERCENT))
    return ((Severity.WARNING, row.warning_percent), (Severity.CRITICAL, row.critical_percent))


def account_uses() -> Iterator[AccountUse]:
    """Every account's input and output use, with its thresholds (two queries whatever the count)."""
    settings = {row.account_id: row for row in AlertThresholds.objects.all()}
    accounts = CapacityAccount.objects.select_related("tenant", "task_class", "pool").order_by("pk")
    for account in accounts:
        thresholds = thresholds_of(settings.get(account.pk))
        yield AccountUse(
            account,
            Dimension.INPUT,
            account.input_limit,
            account.input_reserved,
            account.input_consumed,
            thresholds,
        )
        yield AccountUse(
            account,
            Dimension.OUTPUT,
            account.output_limit,
            account.output_reserved,
            account.output_consumed,
            thresholds,
        )


def record_crossings(*, now: datetime) -> list[ThresholdCrossing]:
    """Record every threshold reached in an account's current period that is not recorded yet; returns the
    new ones. Safe to run twice at once: the unique constraint keeps one row per crossing."""
    found = [
        ThresholdCrossing(
            account=use.account,
            period_start=use.account.period_start,
            dimension=use.dimension,
            severity=severity,
            percent=percent,
            used=use.used,
            limit=use.limit or 0,
            crossed_at=now,
        )
        for use in account_uses()
        for severity, percent in use.crossed()
    ]
    if not found:
        return []
    known = set(
        ThresholdCrossing.objects.filter(
            account_id__in={c.account_id for c in found}, period_start__in={c.period_start for c in found}
        ).values_list("account_id", "period_start", "dimension", "severity")
    )
    new = [c for c in found if (c.account_id, c.period_start, c.dimension, c.severity) not in known]
    with transaction.atomic(durable=True):
        ThresholdCrossing.objects.bulk_create(new, ignore_conflicts=True)
    return new
