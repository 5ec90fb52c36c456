"""Builders for ledger tests: a small catalog with accounts, and admission specs without the ladder."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, cast

from django.db import connection

from budgeting.catalog.models import ModelPool, ModelRevision, TaskClass, Tenant
from ledger.models import CapacityAccount, Reservation, Scope
from ledger.services import admission as ledger_admission
from ledger.services import lifecycle
from tests.factories import (
    AccountFactory,
    ModelPoolFactory,
    ModelRevisionFactory,
    TaskClassFactory,
    TenantFactory,
)

DIGEST = "sha256:" + "a" * 64


@dataclass
class Catalog:
    tenant: Tenant
    task_class: TaskClass
    pool: ModelPool
    model: ModelRevision


def catalog(*, tenant_slug: str = "t-1", pool_slug: str = "pool-1", task_slug: str = "task-1") -> Catalog:
    pool = cast(ModelPool, ModelPoolFactory(slug=pool_slug))
    return Catalog(
        tenant=cast(Tenant, TenantFactory(slug=tenant_slug)),
        task_class=cast(TaskClass, TaskClassFactory(slug=task_slug)),
        pool=pool,
        model=cast(ModelRevision, ModelRevisionFactory(name=f"m-{pool_slug}@2026-07-01", pools=[pool])),
    )


def tenant_account(cat: Catalog, **limits: Any) -> CapacityAccount:
    return cast(CapacityAccount, AccountFactory(scope=Scope.TENANT, tenant=cat.tenant, **limits))


def pool_account(cat: Catalog, **limits: Any) -> CapacityAccount:
    return cast(CapacityAccount, AccountFactory(scope=Scope.POOL, pool=cat.pool, **limits))


def spec(
    cat: Catalog,
    *,
    key: str | None = None,
    input_tokens: int = 100,
    output_tokens: int = 50,
    digest: str = DIGEST,
    queue: bool = False,
) -> ledger_admission.AdmissionSpec:
    key = key or uuid.uuid4().hex
    return ledger_admission.AdmissionSpec(
        tenant=cat.tenant,
        task_class=cat.task_class,
        pool=cat.pool,
        model_revision=cat.model,
        request_id=f"req-{key}",
        idempotency_key=key,
        rendered_digest=digest,
        admitted_digest=digest,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        policy_revision=None,
        rung="FULL",
        manifest_id=None,
        queue=queue,
        request_body={"k": key} if queue else None,
    )


def body(reservation: Reservation) -> dict[str, Any]:
    return {"reservationId": str(reservation.pk), "state": reservation.state, "fence": reservation.fence}


def now() -> datetime:
    return datetime.now(UTC)


def admit(s: ledger_admission.AdmissionSpec) -> ledger_admission.Admitted:
    return ledger_admission.reserve(spec=s, build_body=body, now=now())


def run_concurrently(workers: int, task: Callable[[int], Any]) -> list[Any]:
    """Run task(i) in ``workers`` threads released together by a barrier; returns results or exceptions."""
    barrier = threading.Barrier(workers)
    results: list[Any] = [None] * workers

    def run(i: int) -> None:
        try:
            barrier.wait()
            results[i] = task(i)
        except Exception as exc:
            results[i] = exc
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return results


def fail_unsent(r: Reservation, cat: Catalog) -> Callable[[], Reservation]:
    """A failure with proof of non-processing: its input refund is capped in the one statement (what the
    reservation posted in each account's period is read there), so it takes the unlocked path too."""
    return lambda: lifecycle.fail(
        reservation_id=r.pk,
        tenant_ids=[cat.tenant.pk],
        fence=1,
        reason="connection refused",
        request_sent=lifecycle.RequestSent.NO,
        usage=None,
        now=now(),
    )
