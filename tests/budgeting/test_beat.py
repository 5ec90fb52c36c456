"""Every beat entry names a task a worker registers (each room's tasks module, the names kept from before the
tasks moved), and every task runs with the options of the CELERY_TASK_* settings."""

from __future__ import annotations

from budgeting.celery import app

MOVED = {
    "reconciliation.admit_queued": "budgeting.admission.tasks",
    "reconciliation.audit_ledger": "ledger.tasks",
    "reconciliation.expire_temporary_increases": "ledger.tasks",
    "reconciliation.roll_periods": "ledger.tasks",
    "reconciliation.reclaim_expired_leases": "reconciliation.tasks",
}


def test_every_scheduled_task_is_registered_in_its_room_with_the_settings_options(settings):
    app.loader.import_default_modules()
    scheduled = {entry["task"] for entry in app.conf.beat_schedule.values()}
    assert scheduled <= set(app.tasks), scheduled - set(app.tasks)
    for name, module in MOVED.items():
        assert name in scheduled and app.tasks[name].__module__ == module
    for name in scheduled:
        task = app.tasks[name]
        assert task.acks_late is settings.CELERY_TASK_ACKS_LATE is True
        assert task.reject_on_worker_lost is settings.CELERY_TASK_REJECT_ON_WORKER_LOST is True
        assert (task.time_limit, task.soft_time_limit) == (120, 100)
