"""Admission orchestration: resolve the catalog, run the pure ladder, reserve, record the manifest.

Slow work (rendering, counting, the ladder) happens before any transaction. An admission is then ONE
transaction: the manifest, the reservation, its holds and entries, and the stored answer commit together or
not at all (``ledger.services.admission.reserve`` runs ``record`` inside its transaction). The catalog comes
from the caller's in-process snapshot, so a warm admission costs two statements (the version read, the
reserving statement), and one through the hot path, whose reserving statement checks the version itself
(``admit``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from budgeting.admission import drift
from budgeting.admission.count_cache import count_cache
from budgeting.admission.counters.service import provider_count_for
from budgeting.admission.decision_memo import Prepared, decision_memo, memo_key, memoizable
from budgeting.admission.models import Answer, Manifest
from budgeting.admission.request import AdmissionRequest
from budgeting.catalog import snapshot
from budgeting.catalog.errors import (
    CatalogUnchecked,
    Conflict,
    DomainError,
    InvalidInput,
    Unavailable,
    Unprocessable,
)
from budgeting.catalog.models import ModelRevision, RolloutMode, Tenant
from budgeting.catalog.snapshot import Caller, Resolved
from budgeting.db.rows import RecordInsert
from budgeting.observability import metrics, tracing
from ladder.components import ComponentError, Components, Limits
from ladder.counting import CountingUnavailable, SegmentCounter, rendered_digest
from ladder.decide import ESTIMATOR_REVISION, decide
from ladder.decision import Decision
from ladder.messages import build_payload
from ladder.parser import parse_components
from ladder.rungs import ModelSpec, minimum_evidence_ids
from ladder.walk import ProviderCount
from ladder.wire import decision_manifest, decision_response, step_json
from ledger.errors import PriceUnavailable, QuotaExceeded
from ledger.models import Reservation, State
from ledger.services import admission as ledger_admission

LIMITS = Limits()


class ContextBudgetExceeded(Unprocessable):
    code = "CONTEXT_BUDGET_EXCEEDED"
    title = "The request does not fit the context budget, even after the ladder"


@dataclass
class Result:
    status: int
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)
    would_reject: DomainError | None = None
    """In shadow mode, what enforcing would have answered (the API shows it as ``wouldReject``)."""


@dataclass(frozen=True)
class Context:
    """Everything resolved for one admission request, and what the ladder decided for it."""

    caller: Caller
    tenant: Tenant
    resolved: Resolved
    request: AdmissionRequest
    prepared: Prepared
    decision: Decision

    @property
    def components(self) -> Components:
        return self.prepared.components

    @property
    def full_payload(self) -> dict[str, object]:
        """The provider payload of the request as sent, before any rung (built once per request)."""
        return self.prepared.full_payload


def _prepare(
    caller: Caller, request: AdmissionRequest, confirm: Callable[[], object] | None = None
) -> Context:
    """Resolve the catalog, then parse, render and decide, or take all three from the decision memo.
    ``confirm`` (an unchecked caller's): called before a provider's counting API is asked, so a snapshot out
    of date costs no call outside the process."""
    tenant = caller.snapshot.tenant(request.tenant_id, caller.tenant_ids)
    resolved = caller.snapshot.resolve(
        task_class=request.task_class, pool=request.model_pool, model_revision=request.model_revision
    )
    server_digest = resolved.model.tokenizer.digest
    if request.tokenizer_digest is not None and request.tokenizer_digest != server_digest:
        raise Conflict(
            "tokenizerDigest is not the server's tokenizer for this model revision; refresh and recount",
            code="TOKENIZER_MISMATCH",
            serverTokenizerDigest=server_digest,
            clientTokenizerDigest=request.tokenizer_digest,
        )
    if request.policy_revision is not None and request.policy_revision != resolved.policy_revision:
        raise Conflict(
            f"policyRevision {request.policy_revision} is not the active revision {resolved.policy_revision}",
            code="POLICY_REVISION_MISMATCH",
            activePolicyRevision=resolved.policy_revision,
        )
    version = caller.snapshot.version
    policy = caller.snapshot.policy
    drifted = drift.falling_back(None if policy is None else policy.counter_drift)
    # Not keyed (no encoding of the body for nothing) with the memo off, while the catalog has no version, or
    # while a counter's drift makes its counting unavailable (a remembered decision would not know).
    memo_off = not decision_memo().max_bytes or bool(drifted)
    keyed = None if version is None or memo_off else memo_key(request, version)
    prepared = None if keyed is None else _remembered(caller, keyed[0], resolved)
    if prepared is None:
        prepared = _decide(caller, request, resolved, drifted, confirm)
        if keyed is not None and memoizable(prepared.decision):
            decision_memo().put(keyed[0], prepared, keyed[1])
        decision = prepared.decision
    else:
        with tracing.span("admission.ladder") as span:
            span.set_attributes({**_ladder_attributes(prepared.decision), "tokenbudget.memo": "hit"})
        decision = replace(prepared.decision, request_id=request.request_id)
    return Context(caller, tenant, resolved, request, prepared, decision)


def _remembered(caller: Caller, key: str, resolved: Resolved) -> Prepared | None:
    """The memo's entry for ``key``, while the exact counters it was counted with still load (the requested
    model's, and the model it went to)."""
    prepared = decision_memo().get(key)
    if prepared is None or prepared.decision.count is None:
        return prepared
    # A counter depends on its tokenizer only: one check when both models share it (the usual case).
    specs = {spec.tokenizer_digest: spec for spec in (resolved.model_spec, prepared.decision.model)}
    try:
        for spec in specs.values():
            caller.snapshot.counter_for(spec)
    except CountingUnavailable:
        return None
    return prepared


def _counter_for(
    caller: Caller, drifted: frozenset[tuple[str, str]]
) -> Callable[[ModelSpec], SegmentCounter]:
    """The counters of this admission: a model whose counter drifted out of the policy's bound (with
    ``onExceeded: COUNTING_UNAVAILABLE``) cannot count, so the task's counting-unavailable rule decides."""

    def counter_for(spec: ModelSpec) -> SegmentCounter:
        method = "EXACT" if spec.provider_counter is None else "PROVIDER_COUNT"
        if (spec.id, method) in drifted:
            raise CountingUnavailable(
                f"the {method} counter of {spec.id} drifted out of the policy's counterDrift bound"
            )
        return tracing.TracedCounter(caller.snapshot.counter_for(spec))

    return counter_for


def _provider_count(
    count: ProviderCount, drifted: frozenset[tuple[str, str]], confirm: Callable[[], object] | None
) -> ProviderCount:
    """The providers' counts of this admission: a model whose provider count drifted out of the policy's bound
    (``onExceeded: COUNTING_UNAVAILABLE``) cannot be counted by it (for a provider-counted model its local
    counter already refuses; an OpenAI model's bound counter is asked here)."""

    def provider_count(spec: ModelSpec, payload: Mapping[str, object], digest: str) -> int:
        if (spec.id, "PROVIDER_COUNT") in drifted:
            raise CountingUnavailable(
                f"the PROVIDER_COUNT counter of {spec.id} drifted out of the policy's counterDrift bound"
            )
        if confirm is not None:
            confirm()
        return count(spec, payload, digest)

    return provider_count


def _decide(
    caller: Caller,
    request: AdmissionRequest,
    r: Resolved,
    drifted: frozenset[tuple[str, str]],
    confirm: Callable[[], object] | None,
) -> Prepared:
    try:
        components = parse_components(request.components, limits=LIMITS)
    except ComponentError as exc:
        raise InvalidInput(exc.message, code="INVALID_COMPONENTS", path=exc.path, reason=exc.code) from None
    full_payload = build_payload(components)
    started = time.perf_counter()
    cache = count_cache().under_policy(r.policy_revision)
    with tracing.span("admission.ladder") as span:
        try:
            decision = decide(
                components,
                request_id=request.request_id,
                model=r.model_spec,
                requested_max_output=request.max_output,
                task_policy=r.task_policy,
                global_cap=r.global_cap,
                fallback_models=r.fallback_specs,
                counter_for=_counter_for(caller, drifted),
                cache=cache,
                provider_count=_provider_count(
                    provider_count_for(r.pool, caller.snapshot.models, cache), drifted, confirm
                ),
                known=cache.texts,
            )
        except CountingUnavailable as exc:
            raise Unavailable(str(exc), code="COUNTING_UNAVAILABLE", retry_after=5) from None
        span.set_attributes(_ladder_attributes(decision))
    metrics.observe_ladder_latency(time.perf_counter() - started)
    return Prepared(components, full_payload, rendered_digest(full_payload), decision)


def _ladder_attributes(decision: Decision) -> dict[str, str | int]:
    return {
        "tokenbudget.rung": decision.rung,
        "tokenbudget.decision": decision_label(decision),
        "tokenbudget.input_tokens": 0 if decision.count is None else decision.count.total,
    }


def in_ramp(request_id: str, percent: int) -> bool:
    """Stable per-request rollout: the same requestId always lands on the same side of the ramp."""
    bucket = int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:4], "big") % 100
    return bucket < percent


def _mode(ctx: Context) -> str:
    if ctx.tenant.rollout_mode == RolloutMode.SHADOW:
        return RolloutMode.SHADOW
    ramp = min(ctx.resolved.task_class.ramp_percent, ctx.resolved.task_policy.ramp_percent)
    return RolloutMode.ENFORCE if in_ramp(ctx.request.request_id, ramp) else RolloutMode.SHADOW


def _model_used(ctx: Context, decision: Decision) -> ModelRevision:
    if decision.model.id == ctx.resolved.model.name:
        return ctx.resolved.model
    return ctx.caller.snapshot.models[decision.model.id]


def request_fingerprint(ctx: Context) -> str:
    """What an Idempotency-Key is bound to: the FULL payload (by its digest) and every envelope field that
    changes the decision or the reservation (a retry must repeat all of them)."""
    return rendered_digest(
        {"payloadDigest": ctx.prepared.full_digest, "envelope": ctx.request.fingerprint_fields()}
    )


def _decision_body(ctx: Context, decision: Decision) -> dict[str, Any]:
    body = decision_response(decision)
    estimate = ctx.request.client_estimate
    return {
        "requestId": ctx.request.request_id,
        "decision": decision_label(decision),
        **body,
        "renderedDigest": ctx.prepared.full_digest,
        "admittedDigest": decision.rendered_digest,
        "tokenizerDigest": decision.model.tokenizer_digest,
        "policyRevision": ctx.resolved.policy_revision,
        "budget": {
            "input": decision.budget,
            "maxOutput": decision.max_output,
            "contextWindow": decision.model.context_window,
        },
        "steps": [step_json(step) for step in decision.steps],
        "clientEstimate": None
        if estimate is None
        else {
            "inputTokens": estimate.input_tokens,
            "deviation": None if decision.count is None else estimate.input_tokens - decision.count.total,
        },
    }


def decision_label(decision: Decision) -> str:
    if not decision.admitted:
        return decision.code or "REJECTED"
    return "ADMITTED" if decision.rung == "FULL" else "DEGRADED"


def _manifest(ctx: Context, decision: Decision, mode: str, raw: Any) -> Manifest:
    """The decision's manifest, not yet written (it is inserted with the answer the caller gets)."""
    r = ctx.resolved
    return Manifest(
        request_id=ctx.request.request_id,
        tenant=ctx.tenant,
        task_class=r.task_class,
        model_pool=r.pool,
        model_revision=_model_used(ctx, decision),
        tokenizer_digest=decision.model.tokenizer_digest,
        policy_revision=r.policy_revision,
        decision=decision_label(decision),
        rung=decision.rung,
        mode=mode,
        rendered_digest=decision.rendered_digest,
        input_tokens=0 if decision.count is None else decision.count.total,
        count_method=decision.count_method or "",
        request=raw,
        record={
            "lockedRevisions": {
                "model": decision.model.id,
                "requestedModel": r.model.name,
                "tokenizerDigest": decision.model.tokenizer_digest,
                "promptBundleDigest": ctx.request.prompt_bundle_digest,
                "policyRevision": r.policy_revision,
                "estimator": ESTIMATOR_REVISION,
                "templateRevision": decision.template_revision,
                "globalCap": r.global_cap,
                "requestedModelSpec": {
                    "contextWindow": r.model.context_window,
                    "maxOutput": r.model.max_output,
                    "tokenizerDigest": r.model.tokenizer.digest,
                },
            },
            **decision_manifest(decision),
        },
    )


def _record(manifest: Manifest, answer: str) -> int:
    """Insert the manifest with the caller's answer (inside the admission's transaction when there is one)."""
    manifest.answer = answer
    manifest.save(force_insert=True)
    return manifest.pk


def _manifest_insert(manifest: Manifest, answer: str) -> RecordInsert:
    """The manifest's INSERT with the caller's answer, for the reserving statement to run."""
    manifest.answer = answer
    return RecordInsert.of(manifest)


def count(*, caller: Caller, request: AdmissionRequest, include_payload: bool) -> Result:
    """The dry run: the same decision as an admission, without reserving or recording anything. The rendered
    payload is answered only when asked for (it can be most of the response)."""
    ctx = _prepare(caller, request)
    decision = ctx.decision
    body = _decision_body(ctx, decision)
    if include_payload:
        body["payload"] = decision.payload
    return Result(200, body)


def _rejection(ctx: Context, decision: Decision, manifest: Manifest) -> DomainError:
    if decision.code == "COUNTING_UNAVAILABLE":
        return Unavailable(
            "counting is unavailable and the policy rejects",
            code="COUNTING_UNAVAILABLE",
            retry_after=5,
            manifestId=manifest.pk,
        )
    problem_code = decision.code if decision.code == "MINIMUM_EVIDENCE_UNAVAILABLE" else None
    return ContextBudgetExceeded(
        decision.detail or "hard buckets plus the minimum evidence set do not fit",
        code=problem_code,
        reason=decision.code,
        tokens=decision_response(decision)["tokens"],
        budget={"input": decision.budget, "maxOutput": decision.max_output},
        minimumTokensNeeded=decision.minimum_tokens_needed,
        rungsTried=list(decision.rungs_tried),
        steps=[step_json(step) for step in decision.steps],
        recommendations=list(decision.recommendations),
        manifestId=manifest.pk,
    )


def reservation_body(reservation: Reservation, extra: dict[str, Any]) -> dict[str, Any]:
    return {
        **extra,
        "reservationId": str(reservation.pk),
        "state": reservation.state,
        "reserved": {
            "input": reservation.input_reserved,
            "output": reservation.output_reserved,
            "concurrency": 1,
        },
        "lease": {
            "fence": reservation.fence,
            "expiresAt": reservation.lease_expires_at.isoformat() if reservation.lease_expires_at else None,
        },
        "manifestId": reservation.manifest_id,
        **({"providerRequestId": reservation.provider_request_id} if reservation.provider_request_id else {}),
    }


def queued_body(reservation: Reservation) -> dict[str, Any]:
    """The body a queued reservation answers with once the queue admits or rejects it."""
    return reservation_body(reservation, dict((reservation.response_body or {}).get("decisionBody", {})))


def admit(
    *, caller: Caller, request: AdmissionRequest, raw: Any, idempotency_key: str, now: datetime
) -> Result:
    """POST /admissions: decide, and (in ENFORCE) reserve, recording the manifest. Raises DomainError.

    Its latency is observed per rung (``REJECTED`` for a refusal) for the metrics; its span carries
    identifiers and the answer's code, never the request's text.

    An unchecked caller (``Caller.checked_version``: authenticated from the process's catalog snapshot with no
    statement) is confirmed by the reserving statement of a new reservation, which requires the catalog at
    the snapshot's version. Before any other answer — a refusal, shadow mode, the queue, a replay — the
    catalog version is read (``_Confirmation``): the answer stands if it is the snapshot's, and if the
    catalog moved, CatalogUnchecked is raised with nothing written and the caller makes the admission again
    after the catalog read.
    """
    started = time.perf_counter()
    names = {"tokenbudget.tenant": request.tenant_id, "tokenbudget.task_class": request.task_class}
    with tracing.span("admission", names) as span:
        confirmation = _Confirmation(caller)
        try:
            result = _admit(
                confirmation=confirmation, request=request, raw=raw, idempotency_key=idempotency_key, now=now
            )
        except DomainError as exc:
            # A refusal decided on the snapshot stands only if it is current.
            confirmation.confirmed(exc)
            metrics.observe_admission_latency(time.perf_counter() - started, "REJECTED")
            span.set_attributes({"tokenbudget.answer": exc.code, "tokenbudget.rung": "REJECTED"})
            raise
        rung = str(result.body.get("rung", "NONE"))
        metrics.observe_admission_latency(time.perf_counter() - started, rung)
        answer = str(result.body.get("decision") or result.body.get("state") or result.status)
        span.set_attributes({"tokenbudget.answer": answer, "tokenbudget.rung": rung})
    return result


def _admit(
    *, confirmation: _Confirmation, request: AdmissionRequest, raw: Any, idempotency_key: str, now: datetime
) -> Result:
    caller = confirmation.caller
    if not idempotency_key or len(idempotency_key) > 200:
        raise InvalidInput(
            "the Idempotency-Key header is required (at most 200 characters)", code="IDEMPOTENCY_KEY_REQUIRED"
        )
    ctx = _prepare(caller, request, confirmation.confirmed)
    decision = ctx.decision
    request_digest = request_fingerprint(ctx)
    mode = _mode(ctx)
    manifest = _manifest(ctx, decision, mode, raw)
    body = _decision_body(ctx, decision)
    if mode == RolloutMode.SHADOW or not decision.fits:
        confirmation.confirmed()
        # Nothing will be reserved: a retry of a key that was admitted earlier still answers its replay.
        earlier = ledger_admission.find_by_idempotency_key(
            tenant=ctx.tenant, idempotency_key=idempotency_key, rendered_digest=request_digest
        )
        if earlier is not None:
            return _replay(earlier)
    if mode == RolloutMode.SHADOW:
        # Shadow never blocks: whatever was decided (even a rejection) is recorded and counted, and the caller
        # gets its request back unchanged with nothing held.
        _record(manifest, Answer.SHADOW)
        return Result(
            200,
            {
                **body,
                "mode": RolloutMode.SHADOW,
                "manifestId": manifest.pk,
                "payload": ctx.full_payload,
                "note": "shadow: decision recorded, request unchanged, no capacity held",
            },
            would_reject=None if decision.fits else _rejection(ctx, decision, manifest),
        )
    if not decision.fits:
        _record(manifest, decision.code or Answer.REJECTED)
        raise _rejection(ctx, decision, manifest)
    body["payload"] = decision.payload
    body["mode"] = RolloutMode.ENFORCE
    r = ctx.resolved
    spec = ledger_admission.AdmissionSpec(
        tenant=ctx.tenant,
        task_class=r.task_class,
        pool=r.pool,
        model_revision=_model_used(ctx, decision),
        request_id=request.request_id,
        idempotency_key=idempotency_key,
        rendered_digest=request_digest,
        admitted_digest=decision.rendered_digest,
        input_tokens=decision.count.total if decision.count else 0,
        output_tokens=decision.max_output,
        policy_revision=r.policy_revision,
        rung=decision.rung,
        manifest_id=None,
        minimum_evidence_ids=tuple(
            sorted(minimum_evidence_ids(ctx.components.evidence, r.task_policy.minimum_evidence))
        ),
        queue=r.queue_allowed,
        queue_deadline_seconds=r.queue_deadline_seconds,
        request_body={"decisionBody": body},
        provider_request_id=request.provider_request_id or "",
        price=caller.snapshot.price(_model_used(ctx, decision), caller.db_now),
    )
    try:
        with tracing.span("admission.reserve") as span:
            admitted = ledger_admission.reserve(
                spec=spec,
                build_body=lambda res: _first_body(res, body),
                now=now,
                db_now=caller.db_now,
                catalog_version=caller.snapshot.version,
                checked_version=confirmation.caller.checked_version,
                confirm=confirmation.confirmed,
                record=lambda state: _manifest_insert(
                    manifest, Answer.QUEUED if state == State.PROPOSED else Answer.RESERVED
                ),
            )
            span.set_attribute("tokenbudget.state", admitted.reservation.state)
    except (QuotaExceeded, PriceUnavailable) as refused:
        # The ladder admitted it; the ledger did not (nothing was written): no capacity, or a money limit
        # and no price to hold it at. The manifest says so.
        manifest.pk = None
        _record(manifest, Answer(refused.code))
        raise
    if admitted.replayed:
        return _replay(admitted.reservation)
    return _answer(admitted.reservation)


class _Confirmation:
    """An admission's caller, confirmed current once (see ``admit``): ``confirmed()`` reads the catalog
    version for an unchecked caller (one statement, the one the checked path starts with), raises
    CatalogUnchecked if it is not the snapshot's, and from then on the caller is checked; for a checked
    caller it does nothing."""

    def __init__(self, caller: Caller) -> None:
        self.caller = caller

    def confirmed(self, cause: BaseException | None = None) -> Caller:
        if not self.caller.checked:
            current, db_now = snapshot.current()
            if current.version != self.caller.snapshot.version:
                raise CatalogUnchecked from cause
            self.caller = dataclasses.replace(self.caller, db_now=db_now, checked=True)
        return self.caller


def _first_body(reservation: Reservation, body: dict[str, Any]) -> dict[str, Any]:
    if reservation.state == State.PROPOSED:
        return {"decisionBody": body}
    return reservation_body(reservation, body)


def _answer(reservation: Reservation) -> Result:
    if reservation.state == State.PROPOSED:
        body = {
            "reservationId": str(reservation.pk),
            "state": reservation.state,
            "queuePosition": ledger_admission.queue_position(reservation),
            "queueDeadline": reservation.queue_deadline.isoformat() if reservation.queue_deadline else None,
            "poll": f"/api/v1/reservations/{reservation.pk}",
            "reason": reservation.failure_reason,
            "manifestId": reservation.manifest_id,
        }
        return Result(202, body, {"Location": body["poll"], "Retry-After": "2"})
    # The manifest is inserted by the reserving statement, after the stored answer was built: its id comes
    # from the reservation's column.
    body = {**(reservation.response_body or {}), "manifestId": reservation.manifest_id}
    return Result(201, body, {"Location": f"/api/v1/reservations/{reservation.pk}"})


def _replay(reservation: Reservation) -> Result:
    if reservation.state == State.REJECTED:
        raise Conflict(
            f"this Idempotency-Key's request was queued and then rejected ({reservation.failure_reason}); "
            "send it again with a new key",
            code="QUEUE_DEADLINE_PASSED",
            reservationId=str(reservation.pk),
        )
    result = _answer(reservation)
    if result.status == 201:
        result.status = 200
    result.headers["Idempotent-Replayed"] = "true"
    return result
