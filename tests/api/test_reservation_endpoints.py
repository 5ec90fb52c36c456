"""The reservation endpoints over HTTP: the gateway protocol, tenant scoping, and bad input (4xx, nothing
written)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from rest_framework.test import APIClient

from budgeting.api.parsers import loads_strict
from ledger.models import LedgerEntry, Reservation, State, UsageEvent
from tests.factories import ServiceClientFactory, issue_token
from tests.ledger.helpers import admit, catalog, spec, tenant_account

pytestmark = pytest.mark.django_db


@pytest.fixture
def world():
    cat = catalog()
    tenant_account(cat, input_limit=10**6, output_limit=10**6)
    client = ServiceClientFactory(tenants=[cat.tenant])
    token = issue_token(client, "tb_test_token_aaaaaaaaaaaaaaaa")
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    reservation = admit(spec(cat)).reservation
    return api, cat, reservation


def post(api: APIClient, url: str, body: Any, **headers: Any) -> Any:
    raw = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return api.post(url, data=raw, content_type=headers.pop("content_type", "application/json"), **headers)


def url(r: Reservation, action: str = "") -> str:
    return f"/api/v1/reservations/{r.pk}" + (f"/{action}" if action else "")


def snapshot() -> tuple[int, int, list[tuple[str, int]]]:
    return (
        LedgerEntry.objects.count(),
        UsageEvent.objects.count(),
        sorted((str(r.pk) + r.state, r.captured) for r in Reservation.objects.all()),
    )


def test_gateway_protocol_admit_dispatch_usage_final(world):
    api, _, r = world
    got = api.get(url(r))
    assert got.status_code == 200
    assert got.json()["state"] == "RESERVED"
    assert [h["scope"] for h in got.json()["holds"]] == ["TENANT"]
    d = post(
        api,
        url(r, "dispatch"),
        {"fence": 1, "providerRequestId": "prov-1", "admittedDigest": r.admitted_digest},
    )
    assert d.status_code == 200, d.json()
    assert d.json()["state"] == "DISPATCHED"
    u = post(api, url(r, "usage"), {"fence": 1, "usageEventId": "e1", "outputTokens": 5, "final": False})
    assert u.json()["state"] == "RUNNING"
    again = post(api, url(r, "usage"), {"fence": 1, "usageEventId": "e1", "outputTokens": 5, "final": False})
    assert again.json()["applied"] is False
    f = post(
        api,
        url(r, "usage"),
        {"fence": 1, "usageEventId": "e2", "outputTokens": 3, "final": True, "inputTokens": 100},
    )
    body = f.json()
    assert (body["state"], body["outcome"]) == ("SETTLED", "COMPLETED")
    assert body["output"] == {
        "reserved": 50,
        "topUps": 0,
        "captured": 8,
        "remaining": 0,
        "released": 42,
        "overrun": 0,
    }
    # The answer shows the state, amounts and lease; the whole detail is GET's.
    assert "usageEvents" not in body and "ledgerEntries" not in body
    detail = api.get(url(r)).json()
    assert len(detail["usageEvents"]) == 2
    assert {e["kind"] for e in detail["ledgerEntries"]} >= {"HOLD", "POST", "RELEASE"}


def test_another_tenants_reservation_is_404_like_an_unknown_one(world):
    api, _, _ = world
    other = catalog(tenant_slug="t-other", pool_slug="pool-o", task_slug="task-o")
    tenant_account(other)
    theirs = admit(spec(other)).reservation
    foreign = api.get(url(theirs))
    unknown = api.get("/api/v1/reservations/00000000-0000-0000-0000-000000000000")
    assert foreign.status_code == unknown.status_code == 404
    assert foreign.json()["code"] == unknown.json()["code"] == "NOT_FOUND"
    before = snapshot()
    assert post(api, url(theirs, "cancel"), {"fence": 1}).status_code == 404
    assert snapshot() == before


def test_unauthenticated_is_401_problem():
    res = APIClient().get("/api/v1/reservations/00000000-0000-0000-0000-000000000000")
    assert res.status_code == 401
    assert res["Content-Type"].startswith("application/problem+json")
    assert res.json()["code"] == "UNAUTHENTICATED"


BAD_USAGE = [
    ("malformed", '{"fence": 1,', 400, "MALFORMED_JSON"),
    (
        "duplicate key",
        '{"fence": 1, "fence": 1, "usageEventId": "e", "outputTokens": 1, "final": false}',
        400,
        "DUPLICATE_KEY",
    ),
    (
        "NaN",
        '{"fence": 1, "usageEventId": "e", "outputTokens": NaN, "final": false}',
        400,
        "NON_FINITE_NUMBER",
    ),
    (
        "Infinity",
        '{"fence": 1, "usageEventId": "e", "outputTokens": Infinity, "final": false}',
        400,
        "NON_FINITE_NUMBER",
    ),
    (
        "beyond 2^53",
        '{"fence": 1, "usageEventId": "e", "outputTokens": 9007199254740993, "final": false}',
        400,
        "INTEGER_OUT_OF_RANGE",
    ),
    ("negative", {"fence": 1, "usageEventId": "e", "outputTokens": -1, "final": False}, 400, "INVALID_INPUT"),
    (
        "absurd",
        {"fence": 1, "usageEventId": "e", "outputTokens": 10**12, "final": False},
        400,
        "INVALID_INPUT",
    ),
    (
        "string for int",
        {"fence": 1, "usageEventId": "e", "outputTokens": "5", "final": False},
        400,
        "INVALID_INPUT",
    ),
    (
        "true for int",
        {"fence": 1, "usageEventId": "e", "outputTokens": True, "final": False},
        400,
        "INVALID_INPUT",
    ),
    (
        "float for int",
        {"fence": 1, "usageEventId": "e", "outputTokens": 1.5, "final": False},
        400,
        "INVALID_INPUT",
    ),
    ("int for bool", {"fence": 1, "usageEventId": "e", "outputTokens": 1, "final": 0}, 400, "INVALID_INPUT"),
    (
        "unknown field",
        {"fence": 1, "usageEventId": "e", "outputTokens": 1, "final": False, "x": 1},
        400,
        "INVALID_INPUT",
    ),
    ("missing field", {"fence": 1, "usageEventId": "e", "final": False}, 400, "INVALID_INPUT"),
    (
        "lone surrogate",
        '{"fence": 1, "usageEventId": "\\ud800", "outputTokens": 1, "final": false}',
        400,
        "INVALID_STRING",
    ),
    (
        "NUL",
        '{"fence": 1, "usageEventId": "a\\u0000b", "outputTokens": 1, "final": false}',
        400,
        "INVALID_STRING",
    ),
    ("deep nesting", '{"fence": 1, "x": ' + "[" * 100 + "]" * 100 + "}", 400, "NESTING_TOO_DEEP"),
    ("nesting at 65", '{"fence": 1, "x": ' + "[" * 64 + "]" * 64 + "}", 400, "NESTING_TOO_DEEP"),
    ("nesting past recursion", '{"x": ' + "[" * 100_000 + "]" * 100_000 + "}", 400, "NESTING_TOO_DEEP"),
    ("deep objects", '{"fence": 1, "x": ' + '{"a": ' * 70 + "1" + "}" * 70 + "}", 400, "NESTING_TOO_DEEP"),
    (
        "5,000-digit integer",
        '{"fence": ' + "9" * 5000 + ', "usageEventId": "e", "outputTokens": 1, "final": false}',
        400,
        "INTEGER_OUT_OF_RANGE",
    ),
    (
        "negative 5,000-digit integer",
        '{"fence": 1, "usageEventId": "e", "outputTokens": -' + "9" * 5000 + ', "final": false}',
        400,
        "INTEGER_OUT_OF_RANGE",
    ),
    (
        "4,000-digit integer (int() would take it)",
        '{"fence": 1, "usageEventId": "e", "outputTokens": ' + "9" * 4000 + ', "final": false}',
        400,
        "INTEGER_OUT_OF_RANGE",
    ),
    (
        "beyond 2^53, deep in a list",
        '{"fence": 1, "usageEventId": "e", "outputTokens": 1, "final": false, "x": [[1, -9007199254740993]]}',
        400,
        "INTEGER_OUT_OF_RANGE",
    ),
    (
        "a float that overflows",
        '{"fence": 1, "usageEventId": "e", "outputTokens": 1e400, "final": false}',
        400,
        "NON_FINITE_NUMBER",
    ),
    (
        "NUL in a key",
        '{"fence": 1, "usageEventId": "e", "outputTokens": 1, "final": false, "a\\u0000": 1}',
        400,
        "INVALID_STRING",
    ),
    ("array body", "[1, 2]", 400, "INVALID_INPUT"),
    ("not UTF-8", b'{"fence": 1, "usageEventId": "\xff"}', 400, "MALFORMED_JSON"),
    ("empty body: every field missing", "", 400, "INVALID_INPUT"),
    (
        "fence zero",
        {"fence": 0, "usageEventId": "e", "outputTokens": 1, "final": False},
        400,
        "INVALID_INPUT",
    ),
]


@pytest.mark.parametrize(("name", "body", "status", "code"), BAD_USAGE, ids=[b[0] for b in BAD_USAGE])
def test_bad_usage_bodies_are_4xx_and_write_nothing(world, name, body, status, code):
    api, _, r = world
    post(api, url(r, "dispatch"), {"fence": 1, "providerRequestId": "p", "admittedDigest": r.admitted_digest})
    before = snapshot()
    res = post(api, url(r, "usage"), body)
    assert res.status_code == status, res.content
    assert res["Content-Type"].startswith("application/problem+json")
    assert res.json()["code"] == code
    assert snapshot() == before


def test_wrong_content_type_is_415(world):
    api, _, r = world
    res = post(api, url(r, "cancel"), "fence=1", content_type="application/x-www-form-urlencoded")
    assert res.status_code == 415
    assert res.json()["code"] == "UNSUPPORTED_MEDIA_TYPE"


@pytest.mark.parametrize(
    ("content_type", "status"),
    [
        ("application/json; charset=utf-16", 415),
        ('application/json; charset="ISO-8859-1"', 415),
        ("application/json; charset=UTF-8", 200),
        ("application/json;charset=utf8", 200),
    ],
)
def test_a_body_declared_in_another_charset_than_utf8_is_415_and_writes_nothing(world, content_type, status):
    """JSON is UTF-8 (RFC 8259): a body labelled otherwise is refused, not read as UTF-8 regardless."""
    api, _, r = world
    before = snapshot()
    res = post(api, url(r, "lease"), {"fence": 1}, content_type=content_type)
    assert res.status_code == status, res.content
    if status == 415:
        assert res.json()["code"] == "UNSUPPORTED_MEDIA_TYPE"
        assert "UTF-8" in res.json()["detail"]
        assert snapshot() == before


def test_body_too_large_is_413(world, settings):
    api, _, r = world
    settings.MAX_REQUEST_BYTES = 2048
    res = post(api, url(r, "cancel"), {"fence": 1, "pad": "x" * 5000})
    assert res.status_code == 413
    assert res.json()["code"] == "BODY_TOO_LARGE"


def test_stale_fence_and_out_of_order_calls_are_409(world):
    api, _, r = world
    Reservation.objects.filter(pk=r.pk).update(fence=3)
    before = snapshot()
    res = post(api, url(r, "cancel"), {"fence": 2})
    assert (res.status_code, res.json()["code"], res.json()["currentFence"]) == (409, "STALE_FENCE", 3)
    res = post(api, url(r, "usage"), {"fence": 3, "usageEventId": "e", "outputTokens": 1, "final": False})
    assert (res.status_code, res.json()["code"]) == (409, "INVALID_TRANSITION")
    assert snapshot() == before


def test_payload_changed_on_dispatch(world):
    api, _, r = world
    res = post(
        api,
        url(r, "dispatch"),
        {"fence": 1, "providerRequestId": "p", "admittedDigest": "sha256:" + "0" * 64},
    )
    assert (res.status_code, res.json()["code"]) == (409, "PAYLOAD_CHANGED")
    assert Reservation.objects.get(pk=r.pk).state == State.RESERVED


def test_fail_cancel_lease_outcome_topup(world):
    api, _, r = world
    assert post(api, url(r, "lease"), {"fence": 1}).status_code == 200
    assert (
        post(api, url(r, "top-up"), {"fence": 1, "topUpId": "t1", "outputTokens": 10}).json()["output"][
            "topUps"
        ]
        == 10
    )
    post(api, url(r, "dispatch"), {"fence": 1, "providerRequestId": "p", "admittedDigest": r.admitted_digest})
    res = post(api, url(r, "fail"), {"fence": 1, "reason": "connect refused", "requestSent": False})
    assert (res.json()["state"], res.json()["outcome"]) == ("SETTLED", "RELEASED")
    out = post(api, url(r, "outcome"), {"taskSuccess": True, "citedEvidenceIds": ["e1"]})
    assert out.status_code == 200
    bad = post(api, url(r, "fail"), {"fence": 1, "reason": "x", "requestSent": "maybe"})
    assert (bad.status_code, bad.json()["code"]) == (400, "INVALID_INPUT")


def nested_lists(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth - 1):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        # An escaped backslash before "u0000" is text, not a NUL: the fast pre-check may suspect it, the exact
        # check must accept it.
        (b'{"a": "x\\\\u0000"}', {"a": "x\\u0000"}),
        # A surrogate pair is one emoji, not a lone surrogate.
        (b'{"a": "\\ud83d\\ude00"}', {"a": "\U0001f600"}),
        (b'{"a": ' + b"[" * 63 + b"]" * 63 + b"}", {"a": nested_lists(63)}),
        (b'{"n": -9007199254740991}', {"n": -(2**53 - 1)}),
    ],
)
def test_strict_parser_accepts_what_only_looks_suspicious(raw, expected):
    assert loads_strict(raw) == expected
