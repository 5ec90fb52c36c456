"""Admission's beat task: admit queued requests while capacity allows. Its name keeps its first prefix
(``reconciliation.``) so that a running beat's schedule and queued messages still find it. Options: the
CELERY_TASK_* settings."""

from __future__ import annotations

from celery import shared_task
from django.utils import timezone

from budgeting.admission import queue


@shared_task(name="reconciliation.admit_queued")
def admit_queued() -> dict[str, int]:
    return queue.admit_queue(now=timezone.now())
