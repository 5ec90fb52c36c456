"""The budgeting app's beat tasks, each one service call: capacity alerts, and tokens' last-used dates.
Options: the CELERY_TASK_* settings."""

from __future__ import annotations

from celery import shared_task
from django.conf import settings
from django.utils import timezone

from budgeting.catalog import tokens
from budgeting.observability.alerts.service import check_thresholds


@shared_task(name="budgeting.check_alert_thresholds")
def check_alert_thresholds() -> dict[str, int]:
    run = check_thresholds(now=timezone.now(), webhook_url=settings.ALERT_WEBHOOK_URL)
    return {"crossed": run.crossed, "posted": run.posted}


@shared_task(name="budgeting.copy_token_last_used")
def copy_token_last_used() -> dict[str, int]:
    return {"updated": tokens.copy_last_used()}
