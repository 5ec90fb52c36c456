"""The admission queue's beat work: admit queued requests in arrival order while capacity allows."""

from __future__ import annotations

from datetime import datetime

from budgeting.admission.orchestrator import queued_body
from ledger.models import Reservation, State
from ledger.services import admission as ledger_admission


def admit_queue(*, now: datetime, limit: int = 200) -> dict[str, int]:
    """Admit queued requests in arrival order while capacity allows; reject those past their deadline."""
    admitted = rejected = 0
    ids = list(
        Reservation.objects.filter(state=State.PROPOSED)
        .order_by("created_at")
        .values_list("pk", flat=True)[:limit]
    )
    for reservation_id in ids:
        result = ledger_admission.admit_queued(reservation_id=reservation_id, build_body=queued_body, now=now)
        if result is None:
            continue
        if result.state == State.RESERVED:
            admitted += 1
        else:
            rejected += 1
    return {"admitted": admitted, "rejected": rejected, "stillQueued": len(ids) - admitted - rejected}
