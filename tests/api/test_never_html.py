"""Everything under /api/ answers problem+json: unknown paths, wrong methods, a dependency that is down
(503 with Retry-After, and service again without a restart once it is back); chunked bodies are read."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from collections import OrderedDict
from pathlib import Path

import pytest
import redis
from django.contrib.auth.models import User
from django.db import connection
from django.test import Client
from rest_framework.test import APIClient

from budgeting.admission import count_cache
from budgeting.admission.decision_memo import decision_memo
from ladder.counting import TextCounts
from ledger.models import Reservation
from tests import live
from tests.api.test_admissions import request_body
from tests.demo import DEMO_TOKEN as TOKEN

ROOT = Path(__file__).resolve().parents[2]


def assert_problem(res, status: int, code: str) -> dict:
    assert res.status_code == status, res.content[:300]
    assert res["Content-Type"].startswith("application/problem+json")
    body = res.json()
    assert (body["status"], body["code"]) == (status, code)
    return body


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["/api/", "/api/v2/admissions", "/api/v1/nothing", "/api/v1/reservations"])
def test_unknown_api_paths_are_404_problems(path):
    assert_problem(APIClient().get(path), 404, "NOT_FOUND")


@pytest.mark.django_db
def test_the_api_index_lists_the_endpoints():
    res = APIClient().get("/api/v1/")
    assert res.status_code == 200
    body = res.json()
    assert body["schema"] == "/api/v1/schema"
    assert body["endpoints"]["admit"] == "POST /api/v1/admissions"


@pytest.mark.django_db
def test_a_method_the_schema_does_not_take_is_a_json_405_problem():
    res = APIClient().post("/api/v1/schema", {}, format="json")
    assert_problem(res, 405, "METHOD_NOT_ALLOWED")
    assert "GET" in res["Allow"]


@pytest.mark.django_db
def test_the_schema_in_a_format_it_does_not_serve_is_a_406_problem():
    assert_problem(APIClient().get("/api/v1/schema", HTTP_ACCEPT="application/xml"), 406, "NOT_ACCEPTABLE")


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("accept", "status"),
    [
        ("*/*;q=0", 406),
        ("application/json;q=0", 406),
        ("application/json;q=0, */*", 406),
        ("text/html;q=0", 406),
        ("application/json, */*;q=0", 200),
        ("text/html;q=0, application/*;q=0.5", 200),
        ("*/*", 200),
    ],
)
def test_an_accept_header_refusing_json_with_q0_is_406(accept, status):
    res = APIClient().get("/api/v1/", HTTP_ACCEPT=accept)
    if status == 406:
        assert_problem(res, 406, "NOT_ACCEPTABLE")
    else:
        assert res.status_code == 200 and res["Content-Type"].startswith("application/json")


@pytest.mark.django_db
def test_a_post_to_the_reports_is_a_405_problem_whatever_the_session():
    """The reports only read: a POST is refused by the view, not first by the CSRF check (403 ``ERROR``)."""
    anonymous = Client(enforce_csrf_checks=True)
    signed_in = Client(enforce_csrf_checks=True)
    signed_in.force_login(User.objects.create_superuser("boss", "boss@example.com", "pw"))
    for client in (anonymous, signed_in):
        res = client.post("/api/v1/reports", {})
        assert_problem(res, 405, "METHOD_NOT_ALLOWED")
        assert res["Allow"] == "GET"


@pytest.mark.django_db(transaction=True)
def test_database_down_is_503_with_retry_after_and_service_resumes_without_restart(demo_api):
    body = request_body()
    assert demo_api.post("/api/v1/admissions:count", body, format="json").status_code == 200
    real_port = connection.settings_dict["PORT"]
    connection.close()
    connection.settings_dict["PORT"] = str(closed_port())
    try:
        res = demo_api.post("/api/v1/admissions", body, format="json", HTTP_IDEMPOTENCY_KEY="k-down")
        assert_problem(res, 503, "SERVICE_UNAVAILABLE")
        assert int(res["Retry-After"]) > 0
        res = demo_api.get("/api/v1/reservations/00000000-0000-0000-0000-000000000000")
        assert_problem(res, 503, "SERVICE_UNAVAILABLE")
    finally:
        connection.close()
        connection.settings_dict["PORT"] = real_port
    res = demo_api.post("/api/v1/admissions", body, format="json", HTTP_IDEMPOTENCY_KEY="k-down")
    assert res.status_code == 201, res.content[:300]
    assert Reservation.objects.count() == 1


@pytest.mark.django_db
def test_redis_down_counts_exactly_without_the_cache(demo_api, monkeypatch):
    body = request_body()
    body["components"].pop("tools")  # DeepSeek's template does not show tools: they are counted by a bound
    cached = demo_api.post("/api/v1/admissions:count", body, format="json").json()
    layered = count_cache.count_cache()
    monkeypatch.setattr(layered.shared, "client", redis.Redis(port=closed_port(), socket_connect_timeout=1))
    monkeypatch.setattr(layered, "local", OrderedDict())
    monkeypatch.setattr(layered, "texts", TextCounts(layered.texts.max_chars))
    monkeypatch.setattr(count_cache, "_skip_until", 0.0)
    decision_memo().clear()  # else the repeat is answered from the memo, without counting at all
    res = demo_api.post("/api/v1/admissions:count", body, format="json")
    assert res.status_code == 200, res.content[:300]
    assert res.json()["countMethod"] == "EXACT"
    assert res.json()["tokens"] == cached["tokens"]
    assert count_cache._skip_until > time.monotonic()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.django_db(transaction=True)
def test_a_chunked_body_is_read_through_gunicorn(demo_api):
    """Django alone reads a chunked body as empty (no Content-Length); gunicorn decodes the chunks."""
    payload = request_body()
    raw = json.dumps(payload).encode()
    with live.gunicorn() as base:
        req = urllib.request.Request(
            f"{base}/api/v1/admissions:count",
            data=iter([raw[: len(raw) // 2], raw[len(raw) // 2 :]]),
            method="POST",
            headers={
                "Authorization": f"Bearer {TOKEN}",
                "Content-Type": "application/json",
                "Transfer-Encoding": "chunked",
            },
        )
        with urllib.request.urlopen(req, timeout=300) as res:
            assert res.status == 200
            assert json.loads(res.read())["requestId"] == payload["requestId"]
