"""The hook's final usages sent together (``tokenbudget_litellm.reports``), against a scripted stand-in of our
API on a real event loop (no LiteLLM, no database)."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from tokenbudget_gateway.errors import ApiUnavailable
from tokenbudget_gateway.transport import ApiResponse
from tokenbudget_litellm.reports import MAX_REPORTS, REPORTS_PATH, UsageReports

from tests.integrations.test_litellm_calls import ScriptedApi


def report(n: int) -> dict[str, object]:
    return {
        "reservationId": f"res-{n}",
        "fence": 1,
        "usageEventId": f"p-{n}:1",
        "outputTokens": 3,
        "final": True,
    }


def sent_ids(api: ScriptedApi) -> list[list[str]]:
    assert all(sent.path == REPORTS_PATH and sent.method == "POST" for sent in api.sent)
    return [[str(r["reservationId"]) for r in sent.body["usage"]] for sent in api.sent]


def test_reports_within_the_flush_interval_go_in_one_request() -> None:
    api = ScriptedApi()

    async def scenario() -> float:
        reports = UsageReports(api, flush_s=0.2)
        started = time.monotonic()
        for n in range(3):
            reports.add(report(n))
            await asyncio.sleep(0.01)
        assert api.sent == [], "nothing is sent before the first report waited its interval"
        while not api.sent:
            await asyncio.sleep(0.005)
        waited = time.monotonic() - started
        reports.add(report(3))
        await reports.flush()
        return waited

    waited = asyncio.run(scenario())

    assert sent_ids(api) == [["res-0", "res-1", "res-2"], ["res-3"]]
    # The first report waited its interval, not more (with the loop's own slack).
    assert 0.2 <= waited < 0.6, waited


def test_a_full_request_goes_at_once_and_the_rest_follows() -> None:
    api = ScriptedApi()

    async def scenario() -> float:
        reports = UsageReports(api, flush_s=30)
        started = time.monotonic()
        for n in range(2 * MAX_REPORTS + 5):
            reports.add(report(n))
        while len(api.sent) < 2:
            await asyncio.sleep(0.005)
        return time.monotonic() - started

    waited = asyncio.run(scenario())

    # Two full requests without waiting out the 30 s interval; the last five still wait for theirs.
    assert [len(ids) for ids in sent_ids(api)] == [MAX_REPORTS, MAX_REPORTS]
    assert sent_ids(api)[0][0] == "res-0" and sent_ids(api)[1][-1] == f"res-{2 * MAX_REPORTS - 1}"
    assert waited < 5, waited


def test_with_no_interval_reports_go_as_soon_as_the_loop_is_free() -> None:
    api = ScriptedApi()

    async def scenario() -> None:
        reports = UsageReports(api, flush_s=0)
        reports.add(report(0))
        reports.add(report(1))
        await asyncio.sleep(0.05)

    asyncio.run(scenario())

    assert sent_ids(api) == [["res-0", "res-1"]]


def test_each_refused_report_is_logged_and_an_unreachable_api_names_every_reservation(
    caplog: pytest.LogCaptureFixture,
) -> None:
    refused = {
        "results": [
            {"reservationId": "res-0", "status": 200, "applied": True, "state": "SETTLED"},
            {
                "reservationId": "res-1",
                "status": 409,
                "problem": {"code": "STALE_FENCE", "detail": "the lease was taken over"},
            },
        ]
    }
    unreachable = ApiUnavailable("POST", REPORTS_PATH, "no answer within the 5 s deadline", reached=True)
    api = ScriptedApi(ApiResponse(200, {}, refused), unreachable)

    async def scenario() -> None:
        reports = UsageReports(api, flush_s=0)
        reports.add(report(0))
        reports.add(report(1))
        await reports.flush()
        reports.add(report(2))
        reports.add(report(3))
        await reports.flush()

    with caplog.at_level(logging.WARNING, logger="tokenbudget_litellm.reports"):
        asyncio.run(scenario())

    lines = [record.getMessage() for record in caplog.records]
    assert lines == [
        "usage of reservation res-1 refused: 409 STALE_FENCE: the lease was taken over",
        "usage of reservations res-2, res-3 not posted; the reclaimer will settle them: " + str(unreachable),
    ]
