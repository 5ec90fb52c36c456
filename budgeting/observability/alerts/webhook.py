"""The optional alert webhook: each threshold crossing is posted once, as Slack-compatible JSON (``text``
plus an attachment with the figures), to ``ALERT_WEBHOOK_URL``."""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from datetime import datetime
from typing import Any

from django.db.models import F

from budgeting.observability.alerts.models import Severity, ThresholdCrossing

logger = logging.getLogger(__name__)

TIMEOUT_SECONDS = 5.0


class WebhookFailed(Exception):
    """The receiver could not be reached or did not answer 2xx."""


def message(crossing: ThresholdCrossing) -> dict[str, Any]:
    """The Slack-compatible body announcing one crossing."""
    account = crossing.account
    share = crossing.used * 100 / crossing.limit if crossing.limit else 100.0
    icon = ":rotating_light:" if crossing.severity == Severity.CRITICAL else ":warning:"
    period = f"the period from {crossing.period_start:%Y-%m-%d}"
    text = (
        f"{icon} Token budget {crossing.severity}: {account} has used {share:.0f} % of its "
        f"{crossing.dimension} limit in {period} ({crossing.used:,} of {crossing.limit:,} tokens; "
        f"threshold {crossing.percent} %)."
    )
    return {
        "text": text,
        "attachments": [
            {
                "color": "danger" if crossing.severity == Severity.CRITICAL else "warning",
                "fields": [
                    {"title": "account", "value": str(account), "short": True},
                    {"title": "dimension", "value": crossing.dimension, "short": True},
                    {"title": "used (tokens)", "value": f"{crossing.used:,}", "short": True},
                    {"title": "limit (tokens)", "value": f"{crossing.limit:,}", "short": True},
                    {"title": "threshold", "value": f"{crossing.percent} %", "short": True},
                    {"title": "period start", "value": crossing.period_start.isoformat(), "short": True},
                ],
            }
        ],
    }


def post(url: str, body: dict[str, Any]) -> None:
    """POST ``body`` as JSON. Raises WebhookFailed."""
    data = json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_SECONDS) as response:
            if not 200 <= response.status < 300:
                raise WebhookFailed(f"answered {response.status}")
    except (urllib.error.URLError, OSError) as exc:
        raise WebhookFailed(str(exc)) from exc


def notify_pending(*, url: str, now: datetime) -> int:
    """Post every crossing of an account's current period not posted yet; returns how many were posted.

    Each crossing is claimed first by a conditional UPDATE (two beats never post the same one) and released
    again when the post fails, so the next run retries it.
    """
    pending = ThresholdCrossing.objects.filter(
        notified_at__isnull=True, period_start=F("account__period_start")
    ).select_related("account__tenant", "account__task_class", "account__pool")
    posted = 0
    for crossing in pending.order_by("pk"):
        if not ThresholdCrossing.objects.filter(pk=crossing.pk, notified_at__isnull=True).update(
            notified_at=now
        ):
            continue
        try:
            post(url, message(crossing))
        except WebhookFailed as exc:
            ThresholdCrossing.objects.filter(pk=crossing.pk, notified_at=now).update(notified_at=None)
            logger.warning("alert webhook failed for crossing %s, retried next run: %s", crossing.pk, exc)
            continue
        logger.info(
            "alert webhook posted: %s %s of %s", crossing.severity, crossing.dimension, crossing.account
        )
        posted += 1
    return posted
