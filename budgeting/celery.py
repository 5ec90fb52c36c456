"""The Celery application: Redis broker, beat schedule defined in code."""

from __future__ import annotations

import logging.config
import os

from celery import Celery
from celery.signals import beat_init, setup_logging, task_postrun, worker_process_init

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "budgeting.settings")

app = Celery("budgeting")
app.config_from_object("django.conf:settings", namespace="CELERY")
# Each installed app's ``tasks`` module (budgeting, ledger, reconciliation), and admission's, a room of the
# budgeting app.
app.autodiscover_tasks()
app.autodiscover_tasks(["budgeting.admission"])

app.conf.beat_schedule = {
    "reclaim-expired-leases": {"task": "reconciliation.reclaim_expired_leases", "schedule": 15.0},
    "lookup-unknown-outcomes": {"task": "reconciliation.lookup_unknown_outcomes", "schedule": 30.0},
    "admit-queued": {"task": "reconciliation.admit_queued", "schedule": 2.0},
    "audit-ledger": {"task": "reconciliation.audit_ledger", "schedule": 300.0},
    "import-provider-billing": {"task": "reconciliation.import_provider_billing", "schedule": 300.0},
    "expire-temporary-increases": {"task": "reconciliation.expire_temporary_increases", "schedule": 60.0},
    "roll-periods": {"task": "reconciliation.roll_periods", "schedule": 600.0},
    "check-alert-thresholds": {"task": "budgeting.check_alert_thresholds", "schedule": 60.0},
    "copy-token-last-used": {"task": "budgeting.copy_token_last_used", "schedule": 60.0},
}


@setup_logging.connect
def use_django_logging(**kwargs: object) -> None:
    """Workers and beat log like the web processes (settings.LOGGING, structured) instead of Celery's own
    format."""
    from django.conf import settings

    logging.config.dictConfig(settings.LOGGING)


@worker_process_init.connect(weak=False)
@beat_init.connect(weak=False)
def start_tracing(**kwargs: object) -> None:
    """Tracing (if configured) starts in each worker process after the fork: an exporter's thread does not
    survive one."""
    from budgeting.observability import tracing

    tracing.start()


@task_postrun.connect(weak=False)
def flush_held_counts(**kwargs: object) -> None:
    """The counts a task learned go to Redis once it has run, as a request's do once it is answered."""
    from budgeting.admission.count_cache import flush_held_counts

    flush_held_counts()
