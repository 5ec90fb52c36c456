"""The v1 REST API. One view per operation: parse, make one service call, translate the result."""

from __future__ import annotations

import uuid
from typing import Any

from drf_spectacular.utils import (
    OpenApiExample,
    OpenApiParameter,
    OpenApiResponse,
    PolymorphicProxySerializer,
    extend_schema,
)
from rest_framework import serializers as drf_serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from budgeting.admission import orchestrator as admission
from budgeting.admission.request import AdmissionRequest
from budgeting.api import operations
from budgeting.api.fastpath import fast_validator
from budgeting.api.serializers import (
    AdmissionIn,
    AdmittedOut,
    CountOut,
    DispatchIn,
    FailIn,
    FenceIn,
    IndexOut,
    LifecycleAppliedOut,
    LifecycleOut,
    OutcomeIn,
    ProblemOut,
    QueuedOut,
    ReservationOut,
    ShadowOut,
    TopUpIn,
    UsageIn,
    UsageReportsIn,
    UsageResultsOut,
)
from budgeting.catalog.errors import InvalidInput, NotFound
from budgeting.catalog.models import ServiceClient
from budgeting.catalog.snapshot import Caller
from ledger import selectors

ERRORS: dict[Any, Any] = {
    (status, "application/problem+json"): ProblemOut
    for status in (400, 401, 404, 409, 413, 415, 422, 429, 503)
}
LIFECYCLE_ERRORS = (
    " Answers the reservation's state, amounts and lease as the call left them (the full detail — usage "
    "events, ledger entries, holds, manifest — is at GET /api/v1/reservations/{id}). A stale `fence` or a "
    "call out of order is 409; an unknown reservation, or one of another tenant, 404."
)
EXAMPLE_REQUEST = {
    "requestId": "req-74d1",
    "tenantId": "t-19",
    "taskClass": "contract-review",
    "modelPool": "eu-large",
    "modelRevision": "model@2026-07-01",
    "maxOutput": 1600,
    "components": {
        "immutableRules": ["Never reveal another tenant's documents."],
        "authorizationScope": {"permissions": ["contracts:read"]},
        "question": {"text": "Does clause 7 allow termination?"},
        "evidence": [
            {
                "id": "e1",
                "sourceId": "doc-1",
                "text": "Clause 7: either party may terminate with 30 days notice.",
                "score": 0.9,
                "permissions": ["contracts:read"],
            }
        ],
    },
}
_EXAMPLE_DECISION = {
    "requestId": "req-74d1",
    "decision": "ADMITTED",
    "fits": True,
    "rung": "FULL",
    "tokens": {
        "input": 96,
        "maxOutput": 1600,
        "buckets": {"immutableRules": 14, "question": 11, "evidence": 29},
    },
    "countMethod": "EXACT",
    "renderedDigest": "sha256:" + "0" * 64,
    "budget": {"input": 14784, "maxOutput": 1600, "contextWindow": 16384},
    "modelRevision": "model@2026-07-01",
    "removed": [],
    "excluded": [],
    "admittedDigest": "sha256:" + "0" * 64,
    "tokenizerDigest": "sha256:" + "1" * 64,
    "policyRevision": 3,
    "steps": [],
    "clientEstimate": None,
}
_EXAMPLE_PAYLOAD = {
    "messages": [
        {"role": "system", "content": [{"type": "text", "text": "Never reveal another tenant's documents."}]}
    ],
    "model": "model@2026-07-01",
    "max_tokens": 1600,
}


class TenantScopedView(APIView):
    """Tenant scoping happens here, once: every query is filtered by the client's tenants."""

    def client(self) -> ServiceClient:
        client = self.request.user
        assert isinstance(client, ServiceClient)
        return client

    def caller(self) -> Caller:
        caller = self.request.auth
        assert isinstance(caller, Caller)
        return caller

    def tenant_ids(self) -> frozenset[int]:
        return self.caller().tenant_ids

    def validated(self, serializer_class: type[drf_serializers.Serializer], data: Any) -> dict[str, Any]:
        fast = fast_validator(serializer_class)
        validated = None if fast is None else fast(data)
        if validated is not None:
            return validated
        serializer = serializer_class(data=data)
        if not serializer.is_valid():
            raise InvalidInput("the body does not match the schema", errors=serializer.errors)
        return dict(serializer.validated_data)


def _reservation_id(raw: str) -> uuid.UUID:
    try:
        return uuid.UUID(raw)
    except ValueError:
        raise NotFound("no such reservation") from None


def _response(answer: operations.Answer) -> Response:
    response = Response(answer.body, status=answer.status)
    for name, value in answer.headers.items():
        response[name] = value
    return response


class IndexView(APIView):
    """``GET /api/v1/``: what the API offers, for a person or a client finding its way."""

    authentication_classes: list[type] = []
    permission_classes: list[type] = []

    @extend_schema(
        responses={200: IndexOut},
        operation_id="apiIndex",
        summary="What the API offers",
        description="The operations of v1 and where the OpenAPI document is; needs no token.",
    )
    def get(self, request: Request) -> Response:
        reservation = "/api/v1/reservations/{id}"
        return Response(
            {
                "name": "token-budget admission API",
                "version": "v1",
                "schema": "/api/v1/schema",
                "authentication": "Authorization: Bearer <service client token>",
                "endpoints": {
                    "admit": "POST /api/v1/admissions",
                    "count": "POST /api/v1/admissions:count",
                    "reservation": f"GET {reservation}",
                    "lifecycle": [
                        f"POST {reservation}/{action}"
                        for action in ("dispatch", "usage", "top-up", "cancel", "fail", "lease", "outcome")
                    ],
                    "usageReports": "POST /api/v1/reservations:usage",
                    "reports": "GET /api/v1/reports",
                },
            }
        )


class AdmissionView(TenantScopedView):
    @extend_schema(
        request=AdmissionIn,
        responses={
            200: OpenApiResponse(
                PolymorphicProxySerializer(
                    component_name="AdmissionOk",
                    serializers=[AdmittedOut, ShadowOut],
                    resource_type_field_name=None,
                ),
                description="an admitted Idempotency-Key replayed (Idempotent-Replayed), or SHADOW mode",
            ),
            201: OpenApiResponse(AdmittedOut, description="admitted and reserved: send `payload`"),
            202: OpenApiResponse(QueuedOut, description="queued: poll `poll` after Retry-After seconds"),
            **ERRORS,
        },
        operation_id="admit",
        summary="Admit a model call",
        description=(
            "Counts the request's components with the model's tokenizer, walks the policy's ladder "
            "(degrading the request if it must) and, in ENFORCE mode, reserves input, output, spend (priced"
            " at the model revision's price in force, frozen on the reservation) and concurrency on every "
            "account that holds it, recording a replayable manifest. Send the answered `payload` to the "
            "provider, then report dispatch and usage. The same Idempotency-Key with the same request "
            "answers the first answer again. A request that cannot fit is 422 CONTEXT_BUDGET_EXCEEDED, no "
            "capacity 429 QUOTA_EXCEEDED with Retry-After (its `dimension` is input, output, concurrency or"
            " spend, with `requested` and `available`; for spend in micro-units, with `currency`, "
            "`requestedAmount` and `availableAmount`), a spend limit in a currency the model revision has "
            "no price in 422 PRICE_UNAVAILABLE."
        ),
        parameters=[
            OpenApiParameter(
                "Idempotency-Key",
                str,
                OpenApiParameter.HEADER,
                required=True,
                description="at most 200 characters; a retry must repeat the key and the whole request",
            )
        ],
        examples=[
            OpenApiExample("A contract-review request", value=EXAMPLE_REQUEST, request_only=True),
            OpenApiExample(
                "Admitted in full",
                value={
                    **_EXAMPLE_DECISION,
                    "payload": _EXAMPLE_PAYLOAD,
                    "mode": "ENFORCE",
                    "reservationId": "eda820e6-3a5f-4d35-a471-380c6653a5d3",
                    "state": "RESERVED",
                    "reserved": {"input": 96, "output": 1600, "concurrency": 1},
                    "lease": {"fence": 1, "expiresAt": "2026-11-30T20:23:15.637743+00:00"},
                    "manifestId": 1,
                },
                response_only=True,
                status_codes=["201"],
            ),
        ],
    )
    def post(self, request: Request) -> Response:
        answer = operations.admit(
            self.caller(),
            self.validated(AdmissionIn, request.data),
            request.data,
            request.headers.get("Idempotency-Key", ""),
        )
        return _response(answer)


class CountView(TenantScopedView):
    @extend_schema(
        request=AdmissionIn,
        responses={200: CountOut, **ERRORS},
        operation_id="countAdmission",
        summary="Count and decide without reserving",
        description=(
            "The same decision as admit (count, ladder, budget) with nothing reserved or recorded: what "
            "the request would cost and which rung it would take. The rendered payload only with "
            "?include=payload."
        ),
        examples=[
            OpenApiExample("A contract-review request", value=EXAMPLE_REQUEST, request_only=True),
            OpenApiExample("It fits", value=_EXAMPLE_DECISION, response_only=True, status_codes=["200"]),
        ],
        parameters=[
            OpenApiParameter(
                "include",
                str,
                enum=["payload"],
                description="`payload` also answers the rendered provider payload (large; off by default)",
            )
        ],
    )
    def post(self, request: Request) -> Response:
        body = AdmissionRequest.from_wire(self.validated(AdmissionIn, request.data))
        include = {
            part.strip() for part in request.query_params.get("include", "").split(",") if part.strip()
        }
        if include - {"payload"}:
            raise InvalidInput(
                f"include may name only 'payload', not {', '.join(sorted(include - {'payload'}))}",
                code="INVALID_INCLUDE",
            )
        result = admission.count(caller=self.caller(), request=body, include_payload="payload" in include)
        return Response(result.body, status=result.status)


class ReservationView(TenantScopedView):
    @extend_schema(
        responses={200: ReservationOut, **ERRORS},
        operation_id="getReservation",
        summary="Read a reservation",
        description=(
            "Its state, what it holds and used, its lease, usage events, ledger entries, holds and manifest; "
            "the poll target of a queued admission."
        ),
    )
    def get(self, request: Request, reservation_id: str) -> Response:
        reservation = selectors.reservation_for(_reservation_id(reservation_id), self.tenant_ids())
        if reservation is None:
            raise NotFound("no such reservation")
        return Response(selectors.reservation_detail(reservation))


class LifecycleView(TenantScopedView):
    action = ""
    """The key of the call in ``operations.LIFECYCLE``."""

    def post(self, request: Request, reservation_id: str) -> Response:
        call = operations.LIFECYCLE[self.action]
        rid = _reservation_id(reservation_id)
        return _response(call.run(self.caller(), rid, self.validated(call.serializer, request.data)))


class DispatchView(LifecycleView):
    action = "dispatch"

    @extend_schema(
        request=DispatchIn,
        responses={200: LifecycleOut, **ERRORS},
        operation_id="dispatchReservation",
        summary="Record the provider call as sent",
        description="Call it before the provider call: the admitted payload's digest must match."
        + LIFECYCLE_ERRORS,
    )
    def post(self, request: Request, reservation_id: str) -> Response:
        return super().post(request, reservation_id)


class UsageView(LifecycleView):
    action = "usage"

    @extend_schema(
        request=UsageIn,
        responses={200: LifecycleAppliedOut, **ERRORS},
        operation_id="recordUsage",
        summary="Report usage",
        description="Streamed (final false) or final usage; a final report settles the reservation and "
        "releases what was not used. A repeated usageEventId answers applied false." + LIFECYCLE_ERRORS,
    )
    def post(self, request: Request, reservation_id: str) -> Response:
        return super().post(request, reservation_id)


class UsageReportsView(TenantScopedView):
    @extend_schema(
        request=UsageReportsIn,
        responses={200: UsageResultsOut, **ERRORS},
        operation_id="recordUsageReports",
        summary="Report usage for several reservations at once",
        description="Each report is the body of POST /api/v1/reservations/{id}/usage with its "
        "`reservationId`; they are applied in order, each as its own usage call. Each result is the report's "
        "status (200, or the status its own call would answer: 404 for an unknown reservation, 409 for a "
        "stale fence…) with the reservation's `state` and `applied`, or its problem: one refused report does "
        "not stop the others. A body that does not match the schema is 400 with nothing written; a "
        "dependency that is down is 503, and sending the same reports again is safe (each is idempotent by "
        "its usageEventId).",
    )
    def post(self, request: Request) -> Response:
        reports = self.validated(UsageReportsIn, request.data)
        return _response(operations.usage_reports(self.caller(), reports))


class TopUpView(LifecycleView):
    action = "top-up"

    @extend_schema(
        request=TopUpIn,
        responses={200: LifecycleAppliedOut, **ERRORS},
        operation_id="topUpReservation",
        summary="Reserve more output",
        description="Adds output tokens to a running reservation if the accounts allow it (429 if not); a "
        "repeated topUpId answers applied false." + LIFECYCLE_ERRORS,
    )
    def post(self, request: Request, reservation_id: str) -> Response:
        return super().post(request, reservation_id)


class CancelView(LifecycleView):
    action = "cancel"

    @extend_schema(
        request=FenceIn,
        responses={200: LifecycleOut, **ERRORS},
        operation_id="cancelReservation",
        summary="Cancel before dispatch",
        description="Releases everything held by a reservation that was never sent." + LIFECYCLE_ERRORS,
    )
    def post(self, request: Request, reservation_id: str) -> Response:
        return super().post(request, reservation_id)


class FailView(LifecycleView):
    action = "fail"

    @extend_schema(
        request=FailIn,
        responses={200: LifecycleOut, **ERRORS},
        operation_id="failReservation",
        summary="Report a failed provider call",
        description='With whether the request reached the provider (true, false or "unknown") and any usage '
        "seen; what cannot be proved unsent waits for reconciliation." + LIFECYCLE_ERRORS,
    )
    def post(self, request: Request, reservation_id: str) -> Response:
        return super().post(request, reservation_id)


class LeaseView(LifecycleView):
    action = "lease"

    @extend_schema(
        request=FenceIn,
        responses={200: LifecycleOut, **ERRORS},
        operation_id="renewLease",
        summary="Renew the lease",
        description="Extends a long call's lease so the reservation is not reclaimed." + LIFECYCLE_ERRORS,
    )
    def post(self, request: Request, reservation_id: str) -> Response:
        return super().post(request, reservation_id)


class OutcomeView(LifecycleView):
    action = "outcome"

    @extend_schema(
        request=OutcomeIn,
        responses={200: LifecycleOut, **ERRORS},
        operation_id="reportOutcome",
        summary="Report the task's outcome",
        description="Whether the task succeeded and which evidence ids the answer cited (quality by rung)."
        + LIFECYCLE_ERRORS,
    )
    def post(self, request: Request, reservation_id: str) -> Response:
        return super().post(request, reservation_id)
