"""The Celery application: Redis broker, beat schedule defined in code."""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "budgeting.settings")

app = Celery("budgeting")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
