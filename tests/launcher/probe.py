"""Run against a launcher's database (``python -m tests.launcher.probe COMMAND ...`` with its ``TB_VAR_DIR``);
prints one JSON answer. The chaos test uses it to wire the demo pools to its provider simulator and to
read, once the traffic is over, what the platform's own Celery worker and beat settled.

* ``point-pools URL`` — every model pool's provider (lookups, billing exports) at ``URL``.
* ``settle PREFIX TIMEOUT`` — enqueue the reclaim, lookup, queue and billing-import tasks every few seconds
  (the beat's schedule is minutes long for some), wait until no reservation of the run is open or
  RECONCILING, import the provider's billing export once more (here, to know when it is done) and report
  the state of the ledger.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

import django

django.setup()

from django.db.models import Count, F, Q  # noqa: E402
from django.utils import timezone  # noqa: E402

from budgeting.catalog.models import ModelPool  # noqa: E402
from budgeting.celery import app as celery_app  # noqa: E402
from ledger.models import CapacityAccount, Outcome, Reservation, State  # noqa: E402
from ledger.selectors import audit  # noqa: E402
from reconciliation import billing  # noqa: E402
from reconciliation.models import BillingFinding  # noqa: E402

OPEN = [State.PROPOSED, State.RESERVED, State.DISPATCHED, State.RUNNING, State.PARTIALLY_SETTLED]
NUDGES = (
    "reconciliation.reclaim_expired_leases",
    "reconciliation.lookup_unknown_outcomes",
    "reconciliation.admit_queued",
    "reconciliation.import_provider_billing",
)
NUDGE_EVERY_S = 2.0


def point_pools(url: str) -> dict[str, Any]:
    return {"pools": ModelPool.objects.update(provider_base_url=url)}


def settle(prefix: str, timeout: float) -> dict[str, Any]:
    ours = Reservation.objects.filter(request_id__startswith=prefix)
    began = time.monotonic()
    deadline = began + timeout
    while time.monotonic() < deadline and ours.filter(state__in=[*OPEN, State.RECONCILING]).exists():
        for task in NUDGES:
            celery_app.send_task(task)
        time.sleep(NUDGE_EVERY_S)
    settled_after = time.monotonic() - began
    imported = billing.fetch_and_import(now=timezone.now())
    return {**report(prefix), "settle_seconds": round(settled_after, 1), "last_import": imported}


def report(prefix: str) -> dict[str, Any]:
    ours = Reservation.objects.filter(request_id__startswith=prefix)
    states = dict(ours.values_list("state").annotate(n=Count("pk")).order_by())
    settled = {
        provider_request_id: [input_consumed, captured + overrun]
        for provider_request_id, input_consumed, captured, overrun in ours.filter(state=State.SETTLED)
        .exclude(provider_request_id="")
        .values_list("provider_request_id", "input_consumed", "captured", "overrun")
    }
    # Released in full after a dispatch: a refund, which needs the provider's proof of non-processing.
    refunded = list(
        ours.filter(state=State.SETTLED, outcome=Outcome.RELEASED, input_consumed=0)
        .exclude(provider_request_id="")
        .values_list("provider_request_id", flat=True)
    )
    over = CapacityAccount.objects.filter(
        Q(input_limit__isnull=False, input_limit__lt=F("input_consumed") + F("input_reserved"))
        | Q(output_limit__isnull=False, output_limit__lt=F("output_consumed") + F("output_reserved"))
        | Q(concurrency_limit__isnull=False, concurrency_limit__lt=F("in_flight"))
    )
    ledger = audit(timezone.now())
    findings = dict(BillingFinding.objects.values_list("kind").annotate(n=Count("pk")).order_by())
    return {
        "states": states,
        "settled": settled,
        "refunded": refunded,
        "overspent_accounts": [str(account) for account in over],
        "violations": ledger.violations,
        "leaks": ledger.leaks,
        "billing_findings": findings,
    }


COMMANDS: dict[str, Callable[..., dict[str, Any]]] = {
    "point-pools": point_pools,
    "settle": lambda prefix, timeout: settle(prefix, float(timeout)),
}

if __name__ == "__main__":
    print(json.dumps(COMMANDS[sys.argv[1]](*sys.argv[2:])))
