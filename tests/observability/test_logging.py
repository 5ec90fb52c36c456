"""Structured logs: one line per API call with its request id, client, tenant, answer code and reservation id;
expected 4xx answers are that one info line, not a Django warning; JSON in production and key=value lines
in a terminal; Celery's lines about the every-2-seconds queue poll only at debug level."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
import structlog

from budgeting.observability.logging import QuietPolls, settings_logging
from tests.api.test_admissions import api, request_body  # noqa: F401  (api: the demo-provisioned client)

pytestmark = pytest.mark.django_db


def lines(caplog: pytest.LogCaptureFixture, event: str) -> list[dict[str, Any]]:
    return [r.msg for r in caplog.records if isinstance(r.msg, dict) and r.msg.get("event") == event]


def test_an_admission_logs_one_line_with_its_ids_and_answer(api, caplog):  # noqa: F811
    caplog.set_level(logging.INFO)
    response = api.post(
        "/api/v1/admissions",
        request_body(),
        format="json",
        HTTP_IDEMPOTENCY_KEY="k1",
        HTTP_X_REQUEST_ID="rq-1",
    )
    assert response.status_code == 201 and response["X-Request-ID"] == "rq-1"
    (line,) = lines(caplog, "api call")
    assert line["request_id"] == "rq-1" and line["status"] == 201
    assert line["client"] == "gateway-eu" and line["tenant"] == "t-19"
    assert line["answer"] == response.json()["decision"]
    assert line["reservation_id"] == response.json()["reservationId"]
    assert line["client_request_id"] == "req-74d1"
    # A lifecycle call names its reservation from the path.
    rid = line["reservation_id"]
    caplog.clear()
    api.get(f"/api/v1/reservations/{rid}")
    (line,) = lines(caplog, "api call")
    assert line["reservation_id"] == rid and line["answer"] == "RESERVED" and line["tenant"] == "t-19"
    assert len(line["request_id"]) == 32  # none offered: a new one


def test_an_expected_client_error_is_one_info_line_with_its_code(api, caplog):  # noqa: F811
    caplog.set_level(logging.INFO)
    body = request_body(tenantId="t-unknown")
    response = api.post("/api/v1/admissions", body, format="json", HTTP_IDEMPOTENCY_KEY="k2")
    assert response.status_code == 404
    (line,) = lines(caplog, "api call")
    assert (line["status"], line["answer"], line["tenant"]) == (404, "TENANT_NOT_FOUND", "t-unknown")
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    caplog.clear()
    api.get("/api/v1/nowhere")
    (line,) = lines(caplog, "api call")
    assert (line["status"], line["answer"]) == (404, "NOT_FOUND")
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def render(json_lines: bool, record: logging.LogRecord) -> str:
    config = settings_logging(json_lines=json_lines, level="INFO")["formatters"]["structured"]
    factory = config.pop("()")
    return factory(**config).format(record)


def test_json_in_production_and_readable_lines_in_a_terminal():
    structlog.contextvars.bind_contextvars(request_id="rq-9")
    try:
        record = logging.LogRecord("django.request", logging.INFO, __file__, 1, "served %s", ("x",), None)
        as_json = json.loads(render(True, record))
        assert as_json["event"] == "served x" and as_json["request_id"] == "rq-9"
        assert as_json["level"] == "info" and as_json["logger"] == "django.request" and "timestamp" in as_json
        readable = render(False, record)
        assert "served x" in readable and "request_id=rq-9" in readable and not readable.startswith("{")
    finally:
        structlog.contextvars.clear_contextvars()


@pytest.mark.parametrize(
    ("name", "message", "shown"),
    [
        ("celery.beat", "Scheduler: Sending due task admit-queued (reconciliation.admit_queued)", False),
        ("celery.app.trace", "Task reconciliation.admit_queued[1] succeeded in 0.01s: {}", False),
        ("celery.worker.strategy", "Task reconciliation.admit_queued[1] received", False),
        ("celery.app.trace", "Task reconciliation.audit_ledger[2] succeeded in 0.5s: {}", True),
        ("celery.app.trace", "Task reconciliation.admit_queued[3] raised unexpected: boom", True),
    ],
)
def test_the_queue_poll_is_logged_at_debug_level_only(name, message, shown):
    level = logging.ERROR if "raised" in message else logging.INFO
    record = logging.LogRecord(name, level, __file__, 1, message, (), None)
    assert QuietPolls().filter(record) is shown
    if not shown:
        assert record.levelname == "DEBUG"
    root = logging.getLogger()
    previous = root.level
    root.setLevel(logging.DEBUG)
    try:
        assert QuietPolls().filter(logging.LogRecord(name, level, __file__, 1, message, (), None))
    finally:
        root.setLevel(previous)
