"""What each of the gateway's per-call requests does, once its body is validated and its caller known: the
admission and the seven lifecycle calls. Both ways a request is served call these: the DRF views
(``views``, with the schema, and every request that is not plainly well-formed) and the hot path
(``hotpath``, for the gateway's plainly well-formed calls), so the two cannot answer differently.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from django.utils import timezone
from rest_framework import serializers as drf_serializers

from budgeting.admission import orchestrator as admission
from budgeting.admission.request import AdmissionRequest
from budgeting.api.problems import problem_body
from budgeting.api.serializers import DispatchIn, FailIn, FenceIn, OutcomeIn, TopUpIn, UsageIn
from budgeting.catalog.errors import DomainError, NotFound
from budgeting.catalog.snapshot import Caller
from ledger import selectors
from ledger.models import Reservation
from ledger.services import lifecycle


@dataclass(frozen=True)
class Answer:
    """An operation's answer: its JSON body, status and headers."""

    body: dict[str, Any]
    status: int = 200
    headers: Mapping[str, str] = field(default_factory=dict)


def admit(caller: Caller, data: dict[str, Any], raw: Any, idempotency_key: str) -> Answer:
    """``POST /admissions``: ``data`` is the validated body, ``raw`` the body as parsed."""
    result = admission.admit(
        caller=caller,
        request=AdmissionRequest.from_wire(data),
        raw=raw,
        idempotency_key=idempotency_key,
        now=timezone.now(),
    )
    body = result.body
    if result.would_reject is not None:
        body = {**body, "wouldReject": problem_body(result.would_reject)}
    return Answer(body, result.status, result.headers)


def _left(reservation: Reservation, **extra: Any) -> Answer:
    """The reservation as the call left it (the row it wrote: no statement of its own)."""
    return Answer({**selectors.lifecycle_answer(reservation), **extra})


def _dispatch(caller: Caller, rid: uuid.UUID, body: dict[str, Any]) -> Answer:
    return _left(
        lifecycle.dispatch(
            reservation_id=rid,
            tenant_ids=caller.tenant_ids,
            fence=body["fence"],
            provider_request_id=body["providerRequestId"],
            admitted_digest=body["admittedDigest"],
            now=timezone.now(),
            catalog_version=caller.checked_version,
        )
    )


def _usage(caller: Caller, rid: uuid.UUID, body: dict[str, Any]) -> Answer:
    return _recorded_usage(caller, rid, body, catalog_version=caller.checked_version)


def _recorded_usage(
    caller: Caller,
    rid: uuid.UUID,
    body: dict[str, Any],
    *,
    catalog_version: int | None,
    read: lifecycle.Read | None = None,
) -> Answer:
    usage = lifecycle.Usage(
        usage_event_id=body["usageEventId"],
        output_tokens=body["outputTokens"],
        input_tokens=body.get("inputTokens"),
        final=body["final"],
        cached_input_tokens=body.get("cachedInputTokens"),
    )
    reservation, applied = lifecycle.record_usage(
        reservation_id=rid,
        tenant_ids=caller.tenant_ids,
        fence=body["fence"],
        usage=usage,
        now=timezone.now(),
        catalog_version=catalog_version,
        read=read,
    )
    return _left(reservation, applied=applied)


def usage_reports(caller: Caller, body: dict[str, Any]) -> Answer:
    """``POST /reservations:usage``: each report as its own usage call, in order. A report its call would
    refuse (an unknown reservation, a stale fence…) gets that status and problem in its result, and the
    others go on; a dependency that is down fails the whole request (503), and sending it again is safe
    (each report is idempotent by its ``usageEventId``).

    The reports' reservations are read together first, in one statement (which checks an unchecked caller's
    catalog version before anything is written), each report's write then applying only to the row version
    read for it: one statement a report, not two. A second report of the same reservation reads it again."""
    ids: list[uuid.UUID | None] = []
    for report in body["usage"]:
        try:
            ids.append(uuid.UUID(report["reservationId"]))
        except ValueError:
            ids.append(None)
    reads = lifecycle.read_together(
        [rid for rid in ids if rid is not None], caller.tenant_ids, caller.checked_version
    )
    results = []
    for report, rid in zip(body["usage"], ids, strict=True):
        subject = report["reservationId"]
        if rid is None:
            results.append(_refused(subject, NotFound("no such reservation")))
            continue
        try:
            # The batch's read checked the catalog version: no write of it checks again.
            left = _recorded_usage(caller, rid, report, catalog_version=None, read=reads.pop(rid, None)).body
        except DomainError as exc:
            results.append(_refused(subject, exc))
            continue
        results.append(
            {"reservationId": subject, "status": 200, "applied": left["applied"], "state": left["state"]}
        )
    return Answer({"results": results})


def _refused(subject: str, error: DomainError) -> dict[str, Any]:
    problem = problem_body(error)
    return {"reservationId": subject, "status": problem["status"], "problem": problem}


def _top_up(caller: Caller, rid: uuid.UUID, body: dict[str, Any]) -> Answer:
    reservation, applied = lifecycle.top_up(
        reservation_id=rid,
        tenant_ids=caller.tenant_ids,
        fence=body["fence"],
        top_up_id=body["topUpId"],
        output_tokens=body["outputTokens"],
        now=timezone.now(),
        catalog_version=caller.checked_version,
    )
    return _left(reservation, applied=applied)


def _cancel(caller: Caller, rid: uuid.UUID, body: dict[str, Any]) -> Answer:
    return _left(
        lifecycle.cancel(
            reservation_id=rid,
            tenant_ids=caller.tenant_ids,
            fence=body["fence"],
            now=timezone.now(),
            catalog_version=caller.checked_version,
        )
    )


def _fail(caller: Caller, rid: uuid.UUID, body: dict[str, Any]) -> Answer:
    raw_usage = body.get("usage")
    usage = None
    if raw_usage:
        usage = lifecycle.Usage(
            usage_event_id=raw_usage["usageEventId"],
            output_tokens=raw_usage["outputTokens"],
            input_tokens=raw_usage.get("inputTokens"),
            final=False,
        )
    return _left(
        lifecycle.fail(
            reservation_id=rid,
            tenant_ids=caller.tenant_ids,
            fence=body["fence"],
            reason=body["reason"],
            request_sent=body["requestSent"],
            usage=usage,
            now=timezone.now(),
            catalog_version=caller.checked_version,
        )
    )


def _lease(caller: Caller, rid: uuid.UUID, body: dict[str, Any]) -> Answer:
    return _left(lifecycle.renew_lease(reservation_id=rid, tenant_ids=caller.tenant_ids, fence=body["fence"]))


def _outcome(caller: Caller, rid: uuid.UUID, body: dict[str, Any]) -> Answer:
    return _left(
        lifecycle.record_outcome(
            reservation_id=rid,
            tenant_ids=caller.tenant_ids,
            task_success=body["taskSuccess"],
            cited_evidence_ids=body["citedEvidenceIds"],
        )
    )


@dataclass(frozen=True)
class LifecycleCall:
    """``POST /reservations/{id}/<action>``: its body's serializer and what it does."""

    serializer: type[drf_serializers.Serializer]
    run: Callable[[Caller, uuid.UUID, dict[str, Any]], Answer]
    checks_catalog: bool = False
    """Its first statement (the reservation's read) compares an unchecked caller's catalog version
    (``Caller.checked_version``) before anything is written: it may run with one."""


LIFECYCLE: Mapping[str, LifecycleCall] = {
    "dispatch": LifecycleCall(DispatchIn, _dispatch, checks_catalog=True),
    "usage": LifecycleCall(UsageIn, _usage, checks_catalog=True),
    "top-up": LifecycleCall(TopUpIn, _top_up, checks_catalog=True),
    "cancel": LifecycleCall(FenceIn, _cancel, checks_catalog=True),
    "fail": LifecycleCall(FailIn, _fail, checks_catalog=True),
    "lease": LifecycleCall(FenceIn, _lease),
    "outcome": LifecycleCall(OutcomeIn, _outcome),
}
