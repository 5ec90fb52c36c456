"""The hot path (budgeting/api/hotpath.py) answers the gateway's plainly well-formed per-call requests as
the DRF views answer them — the same status, headers and body, the same problems, nothing more written —
and hands everything else to the views.

Each test sends the same requests both ways: through the platform's middleware (the hot path takes them) and
with the hot path removed from MIDDLEWARE (the views take them). ``drf`` records the views DRF dispatched to,
so each test also proves which way a request went.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

import pytest
from django.db import OperationalError
from rest_framework.test import APIClient
from rest_framework.views import APIView

from budgeting.admission.models import Manifest
from budgeting.api import hotpath, parsers
from ledger.models import CapacityAccount, LedgerEntry, Reservation, Scope, UsageEvent
from ledger.services import lifecycle
from tests.api.test_admissions import TOKEN, api  # noqa: F401  (api: the demo provisioned)

pytestmark = pytest.mark.django_db

HOT = "budgeting.api.hotpath.HotPathMiddleware"
# What differs between two log lines of the same call.
VARYING = ("request_id", "duration_ms", "timestamp")
# What differs between two answers to the same call on two reservations: ids, times, the request's own ids.
_VOLATILE = re.compile(
    r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
    r"|\d{4}-\d\d-\d\dT[0-9:.]+(\+00:00|Z)"
    r"|-(hot|views)\b"
    r'|"manifestId": \d+'
)


@pytest.fixture
def drf(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    dispatched: list[str] = []
    original = APIView.dispatch

    def dispatch(self: APIView, request: Any, *args: Any, **kwargs: Any) -> Any:
        dispatched.append(type(self).__name__)
        return original(self, request, *args, **kwargs)

    monkeypatch.setattr(APIView, "dispatch", dispatch)
    return dispatched


def client(settings: Any, way: str) -> APIClient:
    """A client whose requests go the hot way (the platform's middleware) or through the views only."""
    assert HOT in settings.MIDDLEWARE
    if way == "views":
        settings.MIDDLEWARE = [name for name in settings.MIDDLEWARE if name != HOT]
    api_client = APIClient()
    api_client.credentials(HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    return api_client


def support_request(request_id: str, **overrides: Any) -> dict[str, Any]:
    """An admission shaped as the LiteLLM hook maps a chat request."""
    return {
        "requestId": request_id,
        "tenantId": "t-internal",
        "taskClass": "support-chat",
        "modelPool": "eu-large",
        "modelRevision": "model@2026-07-01",
        "maxOutput": 40,
        "components": {
            "immutableRules": [[{"type": "text", "text": "You answer support questions briefly."}]],
            "authorizationScope": {"permissions": []},
            "outputSafety": [],
            "question": {"parts": [{"type": "text", "text": "How do I reset my password?"}]},
            "recentTurns": [],
            "tools": [],
        },
        **overrides,
    }


def send(api_client: APIClient, path: str, body: Any, **headers: Any) -> Any:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    content_type = headers.pop("content_type", "application/json")
    return api_client.post(path, data=raw, content_type=content_type, **headers)


def seen(response: Any) -> tuple[int, dict[str, str], Any]:
    """What a client sees of an answer, less what is new on every request (its request id)."""
    headers = {name: value for name, value in response.items() if name != "X-Request-ID"}
    return response.status_code, headers, json.loads(response.content) if response.content else None


def alike(response: Any) -> tuple[int, dict[str, str], str]:
    """``seen``, with ids, times and the way's own suffix blanked: two calls' answers on two reservations."""
    status, headers, body = seen(response)
    headers.pop("Content-Length")  # a blanked id is not as long
    blanked = {name: _VOLATILE.sub("~", value) for name, value in headers.items()}
    return status, blanked, _VOLATILE.sub("~", json.dumps(body, sort_keys=True))


def written() -> tuple[int, ...]:
    """The ledger's rows (a refusal's decision is recorded in a manifest, either way)."""
    return Reservation.objects.count(), LedgerEntry.objects.count(), UsageEvent.objects.count()


def lifecycle_calls(api_client: APIClient, way: str) -> list[Any]:
    """Every call a gateway makes, on four reservations: admission (two dispatched in it), dispatch, usage
    (streamed, final, replayed), top-up, lease, outcome, cancel, fail, the usage reports."""
    answers = []
    first = send(
        api_client, "/api/v1/admissions", support_request(f"r1-{way}"), HTTP_IDEMPOTENCY_KEY=f"k1-{way}"
    )
    answers.append(first)
    grant = first.json()
    path = f"/api/v1/reservations/{grant['reservationId']}"
    calls = [
        (
            "dispatch",
            {"fence": 1, "providerRequestId": f"p1-{way}", "admittedDigest": grant["admittedDigest"]},
        ),
        ("top-up", {"fence": 1, "topUpId": f"t1-{way}", "outputTokens": 10}),
        ("lease", {"fence": 1}),
        ("usage", {"fence": 1, "usageEventId": f"u1-{way}", "outputTokens": 5, "final": False}),
        ("usage", {"fence": 1, "usageEventId": f"u1-{way}", "outputTokens": 5, "final": False}),
        (
            "usage",
            {"fence": 1, "usageEventId": f"u2-{way}", "outputTokens": 7, "final": True, "inputTokens": 17},
        ),
        ("outcome", {"taskSuccess": True, "citedEvidenceIds": []}),
    ]
    answers += [send(api_client, f"{path}/{action}", body) for action, body in calls]
    dispatched = support_request(f"r2-{way}", dispatch={"providerRequestId": f"p2-{way}"})
    second = send(api_client, "/api/v1/admissions", dispatched, HTTP_IDEMPOTENCY_KEY=f"k2-{way}")
    failed = {"fence": 1, "reason": "provider 500", "requestSent": "unknown"}
    answers += [
        second,
        send(api_client, f"/api/v1/reservations/{second.json()['reservationId']}/fail", failed),
    ]
    third = send(
        api_client, "/api/v1/admissions", support_request(f"r3-{way}"), HTTP_IDEMPOTENCY_KEY=f"k3-{way}"
    )
    answers += [
        third,
        send(api_client, f"/api/v1/reservations/{third.json()['reservationId']}/cancel", {"fence": 1}),
    ]
    # The usage reports: a fourth reservation's final usage, and one for a reservation that does not exist.
    fourth = send(
        api_client,
        "/api/v1/admissions",
        support_request(f"r4-{way}", dispatch={"providerRequestId": f"p4-{way}"}),
        HTTP_IDEMPOTENCY_KEY=f"k4-{way}",
    )
    report = {"fence": 1, "usageEventId": f"u4-{way}", "outputTokens": 3, "final": True}
    reports = [
        {**report, "reservationId": fourth.json()["reservationId"]},
        {**report, "reservationId": "00000000-0000-4000-8000-000000000000"},
    ]
    answers += [fourth, send(api_client, "/api/v1/reservations:usage", {"usage": reports})]
    # The first admission again: its key replays it.
    answers.append(
        send(api_client, "/api/v1/admissions", support_request(f"r1-{way}"), HTTP_IDEMPOTENCY_KEY=f"k1-{way}")
    )
    return answers


def test_every_call_of_the_gateway_answers_alike_both_ways(api, settings, drf, caplog):  # noqa: F811
    caplog.set_level(logging.INFO)
    hot = lifecycle_calls(client(settings, "hot"), "hot")
    # The outcome's list of evidence ids is left to its serializer (fastpath compiles no list of strings).
    assert drf == ["OutcomeView"], "the hot path took every other call"
    drf.clear()
    views = lifecycle_calls(client(settings, "views"), "views")
    assert len(drf) == len(views)
    assert [alike(answer) for answer in hot] == [alike(answer) for answer in views]
    statuses = [answer.status_code for answer in hot]
    assert statuses == [201, 200, 200, 200, 200, 200, 200, 200, 201, 200, 201, 200, 201, 200, 200]
    assert [r["status"] for r in hot[-2].json()["results"]] == [200, 404]
    assert hot[5].json()["applied"] is False and hot[-1]["Idempotent-Replayed"] == "true"
    # The request log's line of a hot call names what a view's names.
    lines = [r.msg for r in caplog.records if isinstance(r.msg, dict) and r.msg.get("event") == "api call"]
    first_hot, first_view = lines[0], lines[len(hot)]
    assert {k: v for k, v in first_hot.items() if k not in VARYING} == {
        **{k: v for k, v in first_view.items() if k not in VARYING},
        "client_request_id": "r1-hot",
        "reservation_id": hot[0].json()["reservationId"],
    }
    assert (first_hot["client"], first_hot["tenant"], first_hot["answer"]) == (
        "gateway-eu",
        "t-internal",
        "ADMITTED",
    )


def refusals(api_client: APIClient, settled: str, live: str) -> list[Any]:
    admissions = "/api/v1/admissions"
    usage = {"fence": 1, "usageEventId": "late", "outputTokens": 1, "final": True}
    return [
        # A stale fence, an unknown reservation, a call out of order.
        send(api_client, f"/api/v1/reservations/{live}/lease", {"fence": 7}),
        send(api_client, "/api/v1/reservations/00000000-0000-4000-8000-000000000000/cancel", {"fence": 1}),
        send(api_client, f"/api/v1/reservations/{settled}/usage", usage),
        # No capacity (429 with Retry-After), a tenant the client may not name, a key reused for another
        # request.
        send(api_client, admissions, support_request("q-1", maxOutput=4000), HTTP_IDEMPOTENCY_KEY="k-quota"),
        send(api_client, admissions, support_request("x-1", tenantId="t-nobody"), HTTP_IDEMPOTENCY_KEY="k-x"),
        send(api_client, admissions, support_request("other"), HTTP_IDEMPOTENCY_KEY="k-live"),
    ]


def test_refusals_are_the_same_problems_both_ways_and_write_nothing(api, settings, drf):  # noqa: F811
    setup = client(settings, "hot")
    live = send(setup, "/api/v1/admissions", support_request("live"), HTTP_IDEMPOTENCY_KEY="k-live").json()
    done = send(setup, "/api/v1/admissions", support_request("done"), HTTP_IDEMPOTENCY_KEY="k-done").json()
    send(setup, f"/api/v1/reservations/{done['reservationId']}/cancel", {"fence": 1})
    CapacityAccount.objects.filter(scope=Scope.TENANT, tenant__slug="t-internal").update(output_limit=100)
    before, drf[:] = written(), []
    hot = refusals(setup, done["reservationId"], live["reservationId"])
    assert drf == [] and written() == before
    views = refusals(client(settings, "views"), done["reservationId"], live["reservationId"])
    assert len(drf) == len(views) and written() == before
    assert [seen(answer) for answer in hot] == [seen(answer) for answer in views]
    assert [(a.status_code, a.json()["code"]) for a in hot] == [
        (409, "STALE_FENCE"),
        (404, "NOT_FOUND"),
        (409, "INVALID_TRANSITION"),
        (429, "QUOTA_EXCEEDED"),
        (404, "TENANT_NOT_FOUND"),
        (409, "IDEMPOTENCY_CONFLICT"),
    ]
    assert all(a["Content-Type"] == "application/problem+json" for a in hot)
    assert int(hot[3]["Retry-After"]) > 0


UNUSUAL: list[tuple[str, dict[str, Any], int]] = [
    ("no token", {"auth": None}, 401),
    ("an unknown token", {"auth": "Bearer tb_nobody_0000000000000000000000"}, 401),
    ("a token that is not ASCII", {"auth": "Bearer tb_dé"}, 401),
    ("another scheme", {"auth": f"Token {TOKEN}"}, 401),
    ("malformed JSON", {"body": b'{"fence": 1,'}, 400),
    ("a field the schema does not know", {"body": {"fence": 1, "extra": True}}, 400),
    ("a fence that is not an integer", {"body": {"fence": "1"}}, 400),
    ("a body in another charset", {"content_type": "application/json; charset=latin-1"}, 415),
    ("another content type", {"content_type": "text/plain"}, 415),
    ("an Accept header refusing JSON", {"HTTP_ACCEPT": "application/json;q=0"}, 406),
    ("a reservation id that is not one", {"path": "/api/v1/reservations/not-a-uuid/lease"}, 404),
]


@pytest.mark.parametrize(("case", "change", "status"), UNUSUAL, ids=[case for case, *_ in UNUSUAL])
def test_what_is_not_plainly_well_formed_goes_to_the_views(api, settings, drf, case, change, status):  # noqa: F811
    api_client = client(settings, "hot")
    grant = send(api_client, "/api/v1/admissions", support_request("u-1"), HTTP_IDEMPOTENCY_KEY="k-u").json()
    before, manifests, drf[:] = written(), Manifest.objects.count(), []
    change = dict(change)
    if "auth" in change:
        auth = change.pop("auth")
        api_client.credentials(**({} if auth is None else {"HTTP_AUTHORIZATION": auth}))
    path = change.pop("path", f"/api/v1/reservations/{grant['reservationId']}/lease")
    body = change.pop("body", {"fence": 1})
    answer = send(api_client, path, body, **change)
    assert drf == ["LeaseView"], case
    assert answer.status_code == status, answer.content
    assert answer["Content-Type"] == "application/problem+json"
    assert (written(), Manifest.objects.count()) == (before, manifests)


def test_a_dependency_down_is_503_and_a_bug_500_on_the_hot_path(api, settings, drf, monkeypatch):  # noqa: F811
    api_client = client(settings, "hot")
    grant = send(api_client, "/api/v1/admissions", support_request("d-1"), HTTP_IDEMPOTENCY_KEY="k-d").json()
    path = f"/api/v1/reservations/{grant['reservationId']}/cancel"

    def down(**kwargs: Any) -> Any:
        raise OperationalError("connection refused")

    monkeypatch.setattr(lifecycle, "cancel", down)
    answer = send(api_client, path, {"fence": 1})
    assert (answer.status_code, answer.json()["code"]) == (503, "SERVICE_UNAVAILABLE")
    assert answer["Retry-After"] == "2" and answer["Content-Type"] == "application/problem+json"

    def bug(**kwargs: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(lifecycle, "cancel", bug)
    answer = send(api_client, path, {"fence": 1})
    assert (answer.status_code, answer.json()["code"]) == (500, "INTERNAL_ERROR")
    assert drf == []


def test_a_body_left_to_the_serializer_is_parsed_once(api, settings, drf, monkeypatch):  # noqa: F811
    api_client = client(settings, "hot")
    parsed: list[int] = []
    loads_strict = parsers.loads_strict

    def counted(raw: bytes) -> Any:
        parsed.append(len(raw))
        return loads_strict(raw)

    monkeypatch.setattr(hotpath, "loads_strict", counted)
    monkeypatch.setattr(parsers, "loads_strict", counted)
    # A string DRF trims: the compiled check leaves the body to the serializer, which accepts it.
    body = support_request("  padded-1  ")
    answer = send(api_client, "/api/v1/admissions", body, HTTP_IDEMPOTENCY_KEY="k-padded")
    assert answer.status_code == 201, answer.content
    assert answer.json()["requestId"] == "padded-1"
    assert drf == ["AdmissionView"]
    assert len(parsed) == 1, "the view's parser answered the body the hot path had parsed"
