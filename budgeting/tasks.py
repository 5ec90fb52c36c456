"""The budgeting app's beat tasks, each one service call: capacity alerts, and tokens' last-used dates."""

from __future__ import annotations

from celery import shared_task
from django.conf import settings
from django.utils import timezone

from budgeting.catalog import tokens
from budgeting.observability.alerts.service import check_thresholds

TASK_OPTIONS = {"acks_late": True, "reject_on_worker_lost": True, "time_limit": 120, "soft_time_limit": 100}


@shared_task(name="budgeting.check_alert_thresholds", **TASK_OPTIONS)
def check_alert_thresholds() -> dict[str, int]:
    run = check_thresholds(now=timezone.now(), webhook_url=settings.ALERT_WEBHOOK_URL)
    return {"crossed": run.crossed, "posted": run.posted}


@shared_task(name="budgeting.copy_token_last_used", **TASK_OPTIONS)
def copy_token_last_used() -> dict[str, int]:
    return {"updated": tokens.copy_last_used()}
