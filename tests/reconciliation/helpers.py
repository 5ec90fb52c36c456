"""Shared steps of the reconciliation tests: dispatched reservations, expired leases, provider calls."""

from __future__ import annotations

import json
import urllib.request
from datetime import timedelta

from ledger.models import Reservation
from ledger.services import lifecycle
from tests.ledger.helpers import admit, now, spec


def expire(reservation: Reservation) -> None:
    Reservation.objects.filter(pk=reservation.pk).update(lease_expires_at=now() - timedelta(seconds=1))


def dispatched(cat, provider_id: str | None = None) -> Reservation:
    r = admit(spec(cat, input_tokens=100, output_tokens=50)).reservation
    return lifecycle.dispatch(
        reservation_id=r.pk,
        tenant_ids=[cat.tenant.pk],
        fence=1,
        provider_request_id=provider_id or f"prov-{r.pk}",
        admitted_digest=r.admitted_digest,
        now=now(),
    )


def call_provider(sim, provider_id: str, max_tokens: int = 20) -> None:
    body = json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": max_tokens}
    ).encode()
    request = urllib.request.Request(
        f"{sim.base_url}/v1/chat/completions",
        data=body,
        method="POST",
        headers={
            "Content-Type": "application/json",
            "X-Request-Id": provider_id,
            "Authorization": "Bearer sk-test",
        },
    )
    with urllib.request.urlopen(request, timeout=5) as response:
        response.read()
