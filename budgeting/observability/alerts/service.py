"""The alert beat's one call: record new threshold crossings, then post the pending ones to the webhook."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from budgeting.observability.alerts.thresholds import record_crossings
from budgeting.observability.alerts.webhook import notify_pending


@dataclass(frozen=True)
class AlertRun:
    crossed: int
    posted: int


def check_thresholds(*, now: datetime, webhook_url: str | None) -> AlertRun:
    """Record the crossings reached since the last run and, when a webhook is configured, post each
    crossing of the current period once."""
    crossed = len(record_crossings(now=now))
    posted = notify_pending(url=webhook_url, now=now) if webhook_url else 0
    return AlertRun(crossed=crossed, posted=posted)
