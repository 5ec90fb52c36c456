"""The protocol calls the LiteLLM hook makes, against a scripted stand-in of our API, and what a failed
provider call may claim in ``requestSent`` (no LiteLLM, no database)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

import pytest
from tokenbudget_gateway.errors import ApiError, ApiUnavailable, ProtocolViolation
from tokenbudget_gateway.transport import ApiResponse
from tokenbudget_litellm.calls import (
    WITHDRAWN,
    Calls,
    Refusal,
    Ticket,
    failure_reason,
    may_have_reached_our_api,
    request_sent_of,
)
from tokenbudget_litellm.mapping import AdmissionRequest

T = TypeVar("T")
NOW = datetime(2026, 11, 30, 11, 59, 0, tzinfo=UTC)

GRANT: dict[str, Any] = {
    "reservationId": "0b6c5a2e-0000-4000-8000-000000000001",
    "mode": "ENFORCE",
    "rung": "DEDUP_EVIDENCE",
    "payload": {"messages": [{"role": "user", "content": [{"type": "text", "text": "q"}]}]},
    "admittedDigest": "sha256:" + "a" * 64,
    "tokens": {"input": 12, "maxOutput": 40},
    "lease": {"fence": 3, "expiresAt": "2026-11-30T12:00:00+00:00"},
}
REQUEST = AdmissionRequest(body={"requestId": "r-1"}, idempotency_key="r-1")
TICKET = Ticket(
    reservation_id="res-1",
    fence=3,
    admitted_digest="sha256:" + "a" * 64,
    provider_request_id="tbr-res-1",
    max_output=40,
    rung="FULL",
)


@dataclass
class Sent:
    method: str
    path: str
    body: Any
    headers: Mapping[str, str] | None


class ScriptedApi:
    """Answers each call with the next scripted answer (an ``ApiResponse`` or an error to raise)."""

    def __init__(self, *answers: ApiResponse | Exception) -> None:
        self.answers = list(answers)
        self.sent: list[Sent] = []

    async def request(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        *,
        sent: asyncio.Event | None = None,
    ) -> ApiResponse:
        self.sent.append(Sent(method, path, body, headers))
        answer = self.answers.pop(0) if self.answers else ApiResponse(200, {}, {})
        if isinstance(answer, Exception):
            raise answer
        return answer


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def run(work: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(work)


def calls(api: ScriptedApi, **kwargs: Any) -> Calls:
    """Calls on the scripted API with the wall clock at ``NOW`` (a minute before the grant's lease ends)."""
    return Calls(api, wall_clock=lambda: NOW, **kwargs)


def test_a_grant_becomes_a_ticket_with_the_payload() -> None:
    api = ScriptedApi(ApiResponse(201, {}, {**GRANT, "modelRevision": "small@2026-05-12"}))

    admitted = run(calls(api, dispatch_at_admission=False).admit(REQUEST))

    assert admitted.ticket == Ticket(
        reservation_id=GRANT["reservationId"],
        fence=3,
        admitted_digest=GRANT["admittedDigest"],
        provider_request_id=f"tbr-{GRANT['reservationId']}",
        max_output=40,
        rung="DEDUP_EVIDENCE",
        model_revision="small@2026-05-12",
        lease_s=60.0,
        dispatched=False,
    )
    assert admitted.payload == GRANT["payload"]
    assert api.sent[0].headers == {"Idempotency-Key": "r-1"}
    assert "dispatch" not in api.sent[0].body
    assert Ticket.from_metadata(admitted.ticket.to_metadata()) == admitted.ticket


def test_the_admission_records_the_dispatch_under_an_id_of_its_idempotency_key() -> None:
    answer = {**GRANT, "state": "DISPATCHED"}
    api = ScriptedApi(*[ApiResponse(201, {}, answer)] * 3)
    other = AdmissionRequest(body={"requestId": "r-2"}, idempotency_key="r-2")

    first = run(calls(api).admit(REQUEST)).ticket
    again = run(calls(api).admit(REQUEST)).ticket
    another = run(calls(api).admit(other)).ticket

    assert first is not None and again is not None and another is not None and first.dispatched
    sent = api.sent[0].body["dispatch"]["providerRequestId"]
    assert first.provider_request_id == sent and sent.startswith("tbr-")
    assert again.provider_request_id == sent, "a repeated admission must name the same id"
    assert another.provider_request_id != sent


def test_a_queued_admission_is_not_dispatched_by_it() -> None:
    queued = ApiResponse(202, {"retry-after": "1"}, {"reservationId": "q-1", "state": "PROPOSED"})
    api = ScriptedApi(queued, ApiResponse(200, {}, {**GRANT, "state": "RESERVED"}))
    clock = Clock()

    ticket = run(
        calls(api, queue_wait_s=5, sleep=clock.sleep, monotonic=lambda: clock.now).admit(REQUEST)
    ).ticket

    assert ticket is not None and not ticket.dispatched
    assert ticket.provider_request_id == f"tbr-{GRANT['reservationId']}"


def test_a_shadow_answer_admits_nothing() -> None:
    admitted = run(calls(ScriptedApi(ApiResponse(200, {}, {"mode": "SHADOW", "payload": {}}))).admit(REQUEST))

    assert (admitted.ticket, admitted.shadow) == (None, True)


@pytest.mark.parametrize(("status", "expected"), [(429, 429), (422, 422), (404, 400), (503, 503), (500, 503)])
def test_a_rejection_is_a_refusal_with_our_status_problem_and_retry_after(status: int, expected: int) -> None:
    problem = {"status": status, "code": "QUOTA_EXCEEDED", "detail": "no output tokens left"}
    api = ScriptedApi(ApiError(status, problem, "/api/v1/admissions", "7"))

    with pytest.raises(Refusal) as refused:
        run(calls(api).admit(REQUEST))

    assert (refused.value.status, refused.value.code, refused.value.retry_after) == (
        expected,
        "QUOTA_EXCEEDED",
        "7",
    )


def test_an_unreachable_api_is_not_a_refusal() -> None:
    with pytest.raises(ApiUnavailable):
        refused = ApiUnavailable("POST", "/api/v1/admissions", "refused", reached=False)
        run(calls(ScriptedApi(refused)).admit(REQUEST))


def test_a_queued_admission_is_asked_again_with_the_same_key_until_admitted() -> None:
    queued = ApiResponse(202, {"retry-after": "2"}, {"reservationId": "q-1", "state": "PROPOSED"})
    api = ScriptedApi(queued, queued, ApiResponse(200, {"idempotent-replayed": "true"}, GRANT))
    clock = Clock()

    admitted = run(calls(api, queue_wait_s=10, sleep=clock.sleep, monotonic=lambda: clock.now).admit(REQUEST))

    assert admitted.ticket is not None
    assert clock.slept == [2.0, 2.0]
    assert [sent.headers for sent in api.sent] == [{"Idempotency-Key": "r-1"}] * 3
    assert len({str(sent.body) for sent in api.sent}) == 1, "the same body, dispatch id included"


def test_a_queued_admission_whose_next_ask_is_refused_still_reached_our_api() -> None:
    queued = ApiResponse(202, {"retry-after": "2"}, {"reservationId": "q-1", "state": "PROPOSED"})
    refused = ApiUnavailable("POST", "/api/v1/admissions", "ClientConnectorError", reached=False)
    clock = Clock()

    api = ScriptedApi(queued, refused)
    waiting = calls(api, queue_wait_s=10, sleep=clock.sleep, monotonic=lambda: clock.now)

    with pytest.raises(ApiUnavailable) as unavailable:
        run(waiting.admit(REQUEST))

    assert unavailable.value.reached, "our API holds the queued admission: the hook withdraws it"
    assert may_have_reached_our_api(unavailable.value)


def test_a_queued_admission_that_does_not_clear_in_time_is_cancelled_and_refused_429() -> None:
    queued = ApiResponse(202, {"retry-after": "2"}, {"reservationId": "q-1", "state": "PROPOSED"})
    reservation = ApiResponse(200, {}, {"lease": {"fence": 1}})
    api = ScriptedApi(queued, queued, reservation, ApiResponse(200, {}, {}))
    clock = Clock()

    with pytest.raises(Refusal) as refused:
        run(calls(api, queue_wait_s=1, sleep=clock.sleep, monotonic=lambda: clock.now).admit(REQUEST))

    assert (refused.value.status, refused.value.code, refused.value.retry_after) == (429, "QUEUED", "2")
    assert [(sent.method, sent.path, sent.body) for sent in api.sent[2:]] == [
        ("GET", "/api/v1/reservations/q-1", None),
        ("POST", "/api/v1/reservations/q-1/cancel", {"fence": 1}),
    ]


def test_a_withdrawn_admission_is_asked_again_with_the_same_key_and_released_in_full() -> None:
    dispatched = ApiResponse(200, {"idempotent-replayed": "true"}, {**GRANT, "state": "DISPATCHED"})
    api = ScriptedApi(dispatched, ApiResponse(200, {}, {}))

    assert run(calls(api).withdraw(REQUEST)) == GRANT["reservationId"]

    admission, release = api.sent
    assert admission.headers == {"Idempotency-Key": "r-1"}
    assert admission.body["dispatch"]["providerRequestId"].startswith("tbr-")
    assert (release.path, release.body) == (
        f"/api/v1/reservations/{GRANT['reservationId']}/fail",
        {"fence": 3, "reason": WITHDRAWN, "requestSent": False},
    ), "no provider call was made for it: proof of non-processing"


def test_a_withdrawn_admission_not_yet_dispatched_is_cancelled() -> None:
    api = ScriptedApi(ApiResponse(201, {}, {**GRANT, "state": "RESERVED"}), ApiResponse(200, {}, {}))

    run(calls(api, dispatch_at_admission=False).withdraw(REQUEST))

    assert [(sent.path, sent.body) for sent in api.sent[1:]] == [
        (f"/api/v1/reservations/{GRANT['reservationId']}/cancel", {"fence": 3})
    ]


def test_a_withdrawn_admission_that_was_refused_or_queued_holds_nothing_or_is_cancelled() -> None:
    refused = ScriptedApi(ApiError(429, {"code": "QUOTA_EXCEEDED"}, "/api/v1/admissions", "3"))
    assert run(calls(refused).withdraw(REQUEST)) is None
    assert len(refused.sent) == 1

    queued = ApiResponse(202, {"retry-after": "2"}, {"reservationId": "q-1", "state": "PROPOSED"})
    api = ScriptedApi(queued, ApiResponse(200, {}, {"lease": {"fence": 1}}), ApiResponse(200, {}, {}))
    assert run(calls(api).withdraw(REQUEST)) == "q-1"
    assert [(sent.method, sent.path) for sent in api.sent[1:]] == [
        ("GET", "/api/v1/reservations/q-1"),
        ("POST", "/api/v1/reservations/q-1/cancel"),
    ]


def test_a_withdrawal_our_api_does_not_answer_is_the_callers_to_log() -> None:
    with pytest.raises(ApiUnavailable):
        hung = ApiUnavailable("POST", "/api/v1/admissions", "hung", reached=True)
        run(calls(ScriptedApi(hung)).withdraw(REQUEST))


@pytest.mark.parametrize(
    ("error", "reached"),
    [
        (ApiUnavailable("POST", "/api/v1/admissions", "ClientConnectorError", reached=False), False),
        (ApiUnavailable("POST", "/api/v1/admissions", "no answer within the deadline", reached=True), True),
        (ProtocolViolation("the admission answer lacks a lease"), True),
        (RuntimeError("a bug of the hook's"), True),
    ],
)
def test_only_a_call_that_never_got_a_connection_did_not_reach_our_api(
    error: BaseException, reached: bool
) -> None:
    assert may_have_reached_our_api(error) is reached


def test_dispatch_usage_fail_and_cancel_carry_the_fence_and_the_provider_ids() -> None:
    api = ScriptedApi()
    made = calls(api)

    async def every_call() -> None:
        await made.dispatch(TICKET)
        made.complete(TICKET, input_tokens=12, output_tokens=30, provider_id="tbr-res-1")
        await made.reports.flush()
        await made.fail(TICKET, request_sent="unknown", reason="Timeout", output_seen=4)
        await made.cancel(TICKET, output_seen=2)

    run(every_call())

    assert [(sent.path.rsplit("/", 1)[-1], sent.body) for sent in api.sent] == [
        (
            "dispatch",
            {"fence": 3, "providerRequestId": "tbr-res-1", "admittedDigest": TICKET.admitted_digest},
        ),
        (
            "reservations:usage",
            {
                "usage": [
                    {
                        "reservationId": "res-1",
                        "fence": 3,
                        "usageEventId": "tbr-res-1:1",
                        "inputTokens": 12,
                        "outputTokens": 30,
                        "final": True,
                    }
                ]
            },
        ),
        (
            "fail",
            {
                "fence": 3,
                "reason": "Timeout",
                "requestSent": "unknown",
                "usage": {"usageEventId": "tbr-res-1:1", "outputTokens": 4},
            },
        ),
        ("usage", {"fence": 3, "usageEventId": "tbr-res-1:1", "outputTokens": 2, "final": False}),
        ("cancel", {"fence": 3}),
    ]


def test_a_renewal_answers_the_leases_new_length() -> None:
    api = ScriptedApi(ApiResponse(200, {}, {"lease": {"fence": 3, "expiresAt": "2026-11-30T11:59:45+00:00"}}))

    assert run(calls(api).renew(TICKET)) == 45.0
    assert (api.sent[0].path, api.sent[0].body) == ("/api/v1/reservations/res-1/lease", {"fence": 3})


def test_a_provider_id_our_api_cannot_take_is_not_used_in_event_ids() -> None:
    api = ScriptedApi()

    async def complete() -> None:
        made = calls(api)
        made.complete(TICKET, input_tokens=1, output_tokens=1, provider_id="bad id with spaces")
        await made.reports.flush()

    run(complete())

    assert api.sent[0].body["usage"][0]["usageEventId"] == "tbr-res-1:1"


# -- requestSent -------------------------------------------------------------------------------------------


class Response:
    def __init__(self, status_code: int) -> None:
        self.status_code = status_code


class HTTPStatusError(Exception):
    """Named as httpx's: an HTTP answer was received."""

    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.response = Response(status)


class APIConnectionError(Exception):
    pass


class LiteLLMError(Exception):
    """Like LiteLLM's exceptions: a status code (500 even for a connection error) and a made-up response."""

    status_code = 500
    response = Response(500)


class APIStatusError(Exception):
    """Named as the OpenAI SDK's: an HTTP answer was received."""

    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.response = Response(status)


class InternalServerError(APIStatusError):
    """As ``litellm.InternalServerError``: a subclass of the OpenAI SDK's, with a made-up 500 even for a
    connection error."""


InternalServerError.__module__ = "litellm.exceptions"


def wrapped_as_litellm(cause: BaseException) -> InternalServerError:
    try:
        raise InternalServerError(500) from cause
    except InternalServerError as error:
        return error


def wrapped(cause: BaseException) -> LiteLLMError:
    try:
        raise LiteLLMError("wrapped") from cause
    except LiteLLMError as error:
        return error


@pytest.mark.parametrize(
    ("error", "chunks", "expected"),
    [
        (wrapped(HTTPStatusError(429)), 0, False),
        (wrapped(HTTPStatusError(400)), 0, False),
        (wrapped(HTTPStatusError(500)), 0, True),
        (wrapped(HTTPStatusError(409)), 0, True),
        (wrapped(APIConnectionError("reset")), 0, "unknown"),
        (wrapped(TimeoutError("read timed out")), 0, "unknown"),
        (wrapped(ConnectionRefusedError("refused")), 0, False),
        (LiteLLMError("no cause"), 0, "unknown"),
        (wrapped(APIConnectionError("reset")), 3, True),
        (wrapped_as_litellm(APIConnectionError("reset")), 0, "unknown"),
        (wrapped_as_litellm(APIStatusError(429)), 0, False),
        (wrapped_as_litellm(APIStatusError(500)), 0, True),
    ],
    ids=[
        "429",
        "400",
        "500",
        "409",
        "reset",
        "timeout",
        "refused",
        "litellm-only",
        "mid-stream",
        "litellm-500-reset",
        "litellm-500-over-429",
        "litellm-500-over-500",
    ],
)
def test_request_sent_is_false_only_with_proof(error: BaseException, chunks: int, expected: object) -> None:
    assert request_sent_of(error, chunks) == expected


def test_the_failure_reason_names_the_providers_status() -> None:
    assert failure_reason(wrapped(HTTPStatusError(429))) == "provider_http_429: LiteLLMError"
    assert failure_reason(wrapped(APIConnectionError("reset"))) == "LiteLLMError: wrapped"
