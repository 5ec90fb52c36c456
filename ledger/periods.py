"""Quota period arithmetic in UTC. Pure functions: the current time is passed in."""

from __future__ import annotations

from datetime import UTC, datetime

EPOCH = datetime(2000, 1, 1, tzinfo=UTC)


def period_start_for(period: str, now: datetime) -> datetime:
    """Start of the period containing ``now``: first of the month, midnight, or a fixed epoch for NONE."""
    now = now.astimezone(UTC)
    if period == "MONTH":
        return datetime(now.year, now.month, 1, tzinfo=UTC)
    if period == "DAY":
        return datetime(now.year, now.month, now.day, tzinfo=UTC)
    if period == "NONE":
        return EPOCH
    raise ValueError(f"unknown period {period!r}")
