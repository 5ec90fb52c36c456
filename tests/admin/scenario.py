"""A small, realistic history for the admin, report and metrics tests: manifests on several rungs,
reservations driven through the real ledger services (completed, overrun, failed on a context overflow,
reconciling), a rejected and a shadow decision, quality outcomes, and a price."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from budgeting.admission.models import Manifest
from budgeting.catalog.models import ModelPool, ModelRevision, Price, RolloutMode, TaskClass, Tenant
from budgeting.catalog.prices import price_at
from ledger.models import Reservation
from ledger.services import admission as ledger_admission
from ledger.services import lifecycle, settlement

DIGEST = "sha256:" + "b" * 64
OTHER = "sha256:" + "c" * 64


def record(
    rung: str, *, tokens: int, steps: list[dict[str, Any]] | None = None, hard_changes: int = 0
) -> dict:
    components = {
        name: {"digestBefore": DIGEST, "digestAfter": DIGEST, "tokens": tokens // 4}
        for name in ("immutableRules", "question", "evidence", "recentTurns")
    }
    return {
        "lockedRevisions": {
            "model": "m",
            "tokenizerDigest": DIGEST,
            "policyRevision": 18,
            "estimator": "e1",
            "globalCap": 60000,
            "requestedModelSpec": {"contextWindow": 32768, "maxOutput": 4096, "tokenizerDigest": DIGEST},
        },
        "rung": rung,
        "components": components,
        "hardBucketChanges": hard_changes,
        "steps": steps or [],
        "removed": [
            {"id": i, "bucket": "evidence", "reason": "DUPLICATE", "rung": rung, "detail": ""}
            for s in steps or []
            for i in s["removedIds"]
        ],
        "excluded": [],
        "rungsTried": ["FULL", *([rung] if rung != "FULL" else [])],
    }


def step(rung: str, removed: list[str], before: int, after: int) -> dict[str, Any]:
    return {
        "rung": rung,
        "removedIds": removed,
        "replacedIds": [],
        "addedIds": [],
        "reason": f"{rung.lower()} to fit",
        "tokensBefore": before,
        "tokensAfter": after,
        "modelId": "m",
        "candidates": [],
    }


@dataclass
class Scenario:
    tenant: Tenant
    task_class: TaskClass
    pool: ModelPool
    model: ModelRevision
    reservations: dict[str, Reservation] = field(default_factory=dict)
    manifests: dict[str, Manifest] = field(default_factory=dict)


def _manifest(
    s: Scenario, name: str, *, decision: str, rung: str, mode: str, tokens: int, **extra: Any
) -> Manifest:
    manifest = Manifest.objects.create(
        request_id=f"req-{name}",
        tenant=s.tenant,
        task_class=s.task_class,
        model_pool=s.pool,
        model_revision=s.model,
        tokenizer_digest=DIGEST,
        policy_revision=18,
        decision=decision,
        rung=rung,
        mode=mode,
        rendered_digest=DIGEST,
        input_tokens=tokens,
        count_method="EXACT",
        request={"requestId": f"req-{name}"},
        record=record(rung, tokens=tokens, **extra),
    )
    s.manifests[name] = manifest
    return manifest


def _admit(
    s: Scenario,
    name: str,
    *,
    rung: str,
    input_tokens: int,
    output_tokens: int,
    minimum: tuple[str, ...] = (),
    **extra: Any,
) -> Reservation:
    manifest = _manifest(
        s,
        name,
        decision="ADMITTED" if rung == "FULL" else "DEGRADED",
        rung=rung,
        mode=RolloutMode.ENFORCE,
        tokens=input_tokens,
        **extra,
    )
    spec = ledger_admission.AdmissionSpec(
        tenant=s.tenant,
        task_class=s.task_class,
        pool=s.pool,
        model_revision=s.model,
        request_id=f"req-{name}",
        idempotency_key=f"key-{name}-{uuid.uuid4().hex[:6]}",
        rendered_digest=DIGEST,
        admitted_digest=DIGEST,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        policy_revision=18,
        rung=rung,
        manifest_id=manifest.pk,
        minimum_evidence_ids=minimum,
        price=price_at(s.model, _now()),
    )
    reservation = ledger_admission.reserve(
        spec=spec, build_body=lambda r: {"reservationId": str(r.pk)}, now=_now()
    ).reservation
    s.reservations[name] = reservation
    return reservation


def _now() -> datetime:
    return datetime.now(UTC)


def _usage(
    s: Scenario, r: Reservation, event: str, output: int, *, final: bool, input_tokens: int | None = None
) -> Reservation:
    return lifecycle.record_usage(
        reservation_id=r.pk,
        tenant_ids=[s.tenant.pk],
        fence=r.fence,
        usage=lifecycle.Usage(event, output, input_tokens, final),
        now=_now(),
    )[0]


def _dispatch(s: Scenario, r: Reservation) -> Reservation:
    return lifecycle.dispatch(
        reservation_id=r.pk,
        tenant_ids=[s.tenant.pk],
        fence=r.fence,
        provider_request_id=f"prov-{r.request_id}",
        admitted_digest=DIGEST,
        now=_now(),
    )


def populate(*, tenant: Tenant, task_class: TaskClass, pool: ModelPool, model: ModelRevision) -> Scenario:
    """Create the history (the catalog's accounts must exist and have room)."""
    s = Scenario(tenant, task_class, pool, model)
    Price.objects.get_or_create(
        model_revision=model,
        effective_from=datetime(2020, 1, 1, tzinfo=UTC),
        defaults={"input_per_million": Decimal("3.000000"), "output_per_million": Decimal("15.000000")},
    )
    ids = [s.tenant.pk]

    full = _admit(s, "full", rung="FULL", input_tokens=1000, output_tokens=200, minimum=("e1", "e2"))
    full = _dispatch(s, full)
    full = _usage(s, full, "u1", 50, final=False)
    _usage(s, full, "u2", 30, final=True, input_tokens=990)
    lifecycle.record_outcome(
        reservation_id=full.pk, tenant_ids=ids, task_success=True, cited_evidence_ids=["e1", "e2"]
    )

    dedup = _admit(
        s,
        "dedup",
        rung="DEDUP_EVIDENCE",
        input_tokens=2000,
        output_tokens=300,
        minimum=("e1", "e2"),
        steps=[step("DEDUP_EVIDENCE", ["e3", "e4"], 2600, 2000)],
    )
    dedup = _dispatch(s, dedup)
    _usage(s, dedup, "u1", 100, final=True, input_tokens=2000)
    lifecycle.record_outcome(
        reservation_id=dedup.pk, tenant_ids=ids, task_success=False, cited_evidence_ids=["e1"]
    )

    over = _admit(
        s,
        "overrun",
        rung="TRIM_EVIDENCE",
        input_tokens=500,
        output_tokens=100,
        steps=[step("TRIM_EVIDENCE", ["e9"], 700, 500)],
    )
    over = _dispatch(s, over)
    _usage(s, over, "u1", 130, final=True, input_tokens=520)

    overflow = _admit(s, "overflow", rung="FULL", input_tokens=800, output_tokens=100)
    overflow = _dispatch(s, overflow)
    lifecycle.fail(
        reservation_id=overflow.pk,
        tenant_ids=ids,
        fence=overflow.fence,
        reason="provider said context_length_exceeded",
        request_sent=lifecycle.RequestSent.YES,
        usage=None,
        now=_now(),
    )

    unknown = _admit(s, "unknown", rung="FULL", input_tokens=700, output_tokens=100)
    unknown = _dispatch(s, unknown)
    Reservation.objects.filter(pk=unknown.pk).update(
        lease_expires_at=_now() - timedelta(minutes=5), dispatched_at=_now() - timedelta(minutes=40)
    )
    settlement.claim_expired_leases(now=_now())

    _manifest(
        s,
        "rejected",
        decision="CONTEXT_BUDGET_EXCEEDED",
        rung="QUEUE_OR_REJECT",
        mode=RolloutMode.ENFORCE,
        tokens=90000,
    )
    _manifest(s, "shadow", decision="ADMITTED", rung="FULL", mode=RolloutMode.SHADOW, tokens=400)
    for name, r in s.reservations.items():
        s.reservations[name] = Reservation.objects.get(pk=r.pk)
    return s
