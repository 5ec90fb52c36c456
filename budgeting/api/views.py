"""The v1 REST API. One view per operation: parse, make one service call, translate the result."""

from __future__ import annotations

import uuid
from typing import Any

from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, inline_serializer
from rest_framework import serializers as drf_serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from budgeting.admission import orchestrator as admission
from budgeting.admission.request import AdmissionRequest
from budgeting.api.problems import problem_body
from budgeting.api.serializers import (
    AdmissionIn,
    DispatchIn,
    FailIn,
    FenceIn,
    OutcomeIn,
    TopUpIn,
    UsageIn,
)
from budgeting.catalog.errors import InvalidInput, NotFound
from budgeting.catalog.models import ServiceClient
from budgeting.catalog.snapshot import Caller
from ledger import selectors
from ledger.services import lifecycle

ProblemOut = inline_serializer(
    "Problem",
    {
        "type": drf_serializers.CharField(),
        "title": drf_serializers.CharField(),
        "status": drf_serializers.IntegerField(),
        "code": drf_serializers.CharField(),
        "detail": drf_serializers.CharField(),
    },
)
ERRORS: dict[Any, Any] = {
    (status, "application/problem+json"): ProblemOut
    for status in (400, 401, 404, 409, 413, 415, 422, 429, 503)
}
AnyObject = OpenApiTypes.OBJECT


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
        serializer = serializer_class(data=data)
        if not serializer.is_valid():
            raise InvalidInput("the body does not match the schema", errors=serializer.errors)
        return dict(serializer.validated_data)


def _reservation_id(raw: str) -> uuid.UUID:
    try:
        return uuid.UUID(raw)
    except ValueError:
        raise NotFound("no such reservation") from None


class IndexView(APIView):
    """``GET /api/v1/``: what the API offers, for a person or a client finding its way."""

    authentication_classes: list[type] = []
    permission_classes: list[type] = []

    @extend_schema(responses={200: AnyObject}, operation_id="apiIndex")
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
                    "reports": "GET /api/v1/reports",
                },
            }
        )


class AdmissionView(TenantScopedView):
    @extend_schema(
        request=AdmissionIn,
        responses={200: AnyObject, 201: AnyObject, 202: AnyObject, **ERRORS},
        operation_id="admit",
    )
    def post(self, request: Request) -> Response:
        key = request.headers.get("Idempotency-Key", "")
        admission_request = AdmissionRequest.from_wire(self.validated(AdmissionIn, request.data))
        result = admission.admit(
            caller=self.caller(),
            request=admission_request,
            raw=request.data,
            idempotency_key=key,
            now=timezone.now(),
        )
        body = result.body
        if result.would_reject is not None:
            body = {**body, "wouldReject": problem_body(result.would_reject)}
        response = Response(body, status=result.status)
        for name, value in result.headers.items():
            response[name] = value
        return response


class CountView(TenantScopedView):
    @extend_schema(
        request=AdmissionIn,
        responses={200: AnyObject, **ERRORS},
        operation_id="countAdmission",
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
        include = {part.strip() for part in request.query_params.get("include", "").split(",")}
        result = admission.count(caller=self.caller(), request=body, include_payload="payload" in include)
        return Response(result.body, status=result.status)


class ReservationView(TenantScopedView):
    @extend_schema(responses={200: AnyObject, **ERRORS}, operation_id="getReservation")
    def get(self, request: Request, reservation_id: str) -> Response:
        reservation = selectors.reservation_for(_reservation_id(reservation_id), self.tenant_ids())
        if reservation is None:
            raise NotFound("no such reservation")
        return Response(selectors.reservation_detail(reservation))


class _LifecycleView(TenantScopedView):
    def respond(self, reservation_id: uuid.UUID, **extra: Any) -> Response:
        reservation = selectors.reservation_for(reservation_id, self.tenant_ids())
        assert reservation is not None
        return Response({**selectors.reservation_detail(reservation), **extra})


class DispatchView(_LifecycleView):
    @extend_schema(
        request=DispatchIn, responses={200: AnyObject, **ERRORS}, operation_id="dispatchReservation"
    )
    def post(self, request: Request, reservation_id: str) -> Response:
        rid = _reservation_id(reservation_id)
        body = self.validated(DispatchIn, request.data)
        lifecycle.dispatch(
            reservation_id=rid,
            tenant_ids=self.tenant_ids(),
            fence=body["fence"],
            provider_request_id=body["providerRequestId"],
            admitted_digest=body["admittedDigest"],
            now=timezone.now(),
        )
        return self.respond(rid)


class UsageView(_LifecycleView):
    @extend_schema(request=UsageIn, responses={200: AnyObject, **ERRORS}, operation_id="recordUsage")
    def post(self, request: Request, reservation_id: str) -> Response:
        rid = _reservation_id(reservation_id)
        body = self.validated(UsageIn, request.data)
        usage = lifecycle.Usage(
            usage_event_id=body["usageEventId"],
            output_tokens=body["outputTokens"],
            input_tokens=body.get("inputTokens"),
            final=body["final"],
        )
        _, applied = lifecycle.record_usage(
            reservation_id=rid,
            tenant_ids=self.tenant_ids(),
            fence=body["fence"],
            usage=usage,
            now=timezone.now(),
        )
        return self.respond(rid, applied=applied)


class TopUpView(_LifecycleView):
    @extend_schema(request=TopUpIn, responses={200: AnyObject, **ERRORS}, operation_id="topUpReservation")
    def post(self, request: Request, reservation_id: str) -> Response:
        rid = _reservation_id(reservation_id)
        body = self.validated(TopUpIn, request.data)
        _, applied = lifecycle.top_up(
            reservation_id=rid,
            tenant_ids=self.tenant_ids(),
            fence=body["fence"],
            top_up_id=body["topUpId"],
            output_tokens=body["outputTokens"],
            now=timezone.now(),
        )
        return self.respond(rid, applied=applied)


class CancelView(_LifecycleView):
    @extend_schema(request=FenceIn, responses={200: AnyObject, **ERRORS}, operation_id="cancelReservation")
    def post(self, request: Request, reservation_id: str) -> Response:
        rid = _reservation_id(reservation_id)
        body = self.validated(FenceIn, request.data)
        lifecycle.cancel(
            reservation_id=rid, tenant_ids=self.tenant_ids(), fence=body["fence"], now=timezone.now()
        )
        return self.respond(rid)


class FailView(_LifecycleView):
    @extend_schema(request=FailIn, responses={200: AnyObject, **ERRORS}, operation_id="failReservation")
    def post(self, request: Request, reservation_id: str) -> Response:
        rid = _reservation_id(reservation_id)
        body = self.validated(FailIn, request.data)
        raw_usage = body.get("usage")
        usage = None
        if raw_usage:
            usage = lifecycle.Usage(
                usage_event_id=raw_usage["usageEventId"],
                output_tokens=raw_usage["outputTokens"],
                input_tokens=raw_usage.get("inputTokens"),
                final=False,
            )
        lifecycle.fail(
            reservation_id=rid,
            tenant_ids=self.tenant_ids(),
            fence=body["fence"],
            reason=body["reason"],
            request_sent=body["requestSent"],
            usage=usage,
            now=timezone.now(),
        )
        return self.respond(rid)


class LeaseView(_LifecycleView):
    @extend_schema(request=FenceIn, responses={200: AnyObject, **ERRORS}, operation_id="renewLease")
    def post(self, request: Request, reservation_id: str) -> Response:
        rid = _reservation_id(reservation_id)
        body = self.validated(FenceIn, request.data)
        lifecycle.renew_lease(reservation_id=rid, tenant_ids=self.tenant_ids(), fence=body["fence"])
        return self.respond(rid)


class OutcomeView(_LifecycleView):
    @extend_schema(request=OutcomeIn, responses={200: AnyObject, **ERRORS}, operation_id="reportOutcome")
    def post(self, request: Request, reservation_id: str) -> Response:
        rid = _reservation_id(reservation_id)
        body = self.validated(OutcomeIn, request.data)
        lifecycle.record_outcome(
            reservation_id=rid,
            tenant_ids=self.tenant_ids(),
            task_success=body["taskSuccess"],
            cited_evidence_ids=body["citedEvidenceIds"],
        )
        return self.respond(rid)
