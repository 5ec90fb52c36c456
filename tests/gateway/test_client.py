"""The gateway client against a small in-memory fake of our REST API and the provider simulator.

The fake implements only what SPEC §8 says the client relies on (fences, idempotent usage events,
idempotent admissions); it is not the real API, so these tests pin the client's side of the contract.
No database.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from tokenbudget_gateway.client import GatewayClient
from tokenbudget_gateway.errors import (
    AdmissionQueued,
    ApiError,
    ApiUnavailable,
    ClientDied,
    ProtocolViolation,
    StaleFence,
)
from tokenbudget_gateway.protocol import Grant, provider_request_id_for, usage_event_id
from tokenbudget_gateway.provider import ChatProvider, provider_body
from tokenbudget_gateway.transport import ApiClient, ApiResponse, RetryPolicy, is_retryable_status

from simulation.billing import BillingStatus
from simulation.faults import Fault
from simulation.provider import Simulator

MESSAGES = [
    {"role": "system", "content": "You review contracts."},
    {"role": "user", "content": "What is the cure period for a payment breach?"},
]
ADMISSION = {
    "requestId": "req-74d1",
    "tenantId": "t-19",
    "taskClass": "contract-review",
    "modelPool": "eu-large",
    "modelRevision": "model@2026-07-01",
    "components": {"question": {"text": "What is the cure period?"}},
    "maxOutput": 40,
}


@dataclass
class FakeReservation:
    reservation_id: str
    fence: int = 1
    state: str = "RESERVED"
    provider_request_id: str | None = None
    provider_saw_it_before_dispatch: bool | None = None
    usage: dict[str, dict[str, Any]] = field(default_factory=dict)
    captured: int = 0
    input_tokens: int | None = None
    final: bool = False
    terminal: dict[str, Any] | None = None
    renewals: int = 0


@dataclass
class Call:
    method: str
    path: str
    headers: dict[str, str]
    body: Any

    @property
    def action(self) -> str:
        return "admission" if self.path.endswith("/admissions") else self.path.rsplit("/", 1)[-1]


class FakeApi:
    """Our API reduced to the gateway's calls, recording each one (including retried attempts)."""

    def __init__(
        self, sim: Simulator | None = None, *, lease_ttl_s: float = 30.0, max_output: int = 40
    ) -> None:
        self.sim = sim
        self.lease_ttl_s = lease_ttl_s
        self.max_output = max_output
        self.calls: list[Call] = []
        self.reservations: dict[str, FakeReservation] = {}
        self.admissions: dict[str, dict[str, Any]] = {}
        self.lose_response: dict[str, int] = {}  # action -> how many answers to drop after applying
        self.answer: dict[str, tuple[int, dict[str, Any]]] = {}  # action -> canned answer, nothing applied
        self.before: Callable[[FakeApi, Call], None] | None = None
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    @property
    def base_url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host!s}:{port}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def actions(self) -> list[str]:
        return [call.action for call in self.calls]

    def only(self) -> FakeReservation:
        [reservation] = self.reservations.values()
        return reservation

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                call = Call("POST", self.path, {k.lower(): v for k, v in self.headers.items()}, body)
                with api.lock:
                    api.calls.append(call)
                    if api.before is not None:
                        api.before(api, call)
                    if call.action in api.answer:
                        status, answer = api.answer[call.action]
                    else:
                        status, answer = api._apply(call)
                    if api.lose_response.get(call.action, 0) > 0:
                        api.lose_response[call.action] -= 1
                        self.close_connection = True
                        return
                data = json.dumps(answer).encode()
                self.send_response(status)
                kind = "application/json" if status < 400 else "application/problem+json"
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                if answer.pop("_replayed", False):
                    self.send_header("Idempotent-Replayed", "true")
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        return Handler

    def _apply(self, call: Call) -> tuple[int, dict[str, Any]]:
        if call.action == "admission":
            key = call.headers.get("idempotency-key")
            if key is None:
                return 400, problem(400, "IDEMPOTENCY_KEY_REQUIRED")
            if key in self.admissions:
                return 200, {**self.admissions[key], "_replayed": True}
            reservation_id = f"r-{len(self.reservations) + 1}"
            self.reservations[reservation_id] = FakeReservation(reservation_id)
            granted = {
                "reservationId": reservation_id,
                "state": "RESERVED",
                "rung": "FULL",
                "tokens": {"input": 30, "maxOutput": self.max_output, "buckets": {}},
                "countMethod": "exact",
                "payload": {"model": "sim-large", "messages": MESSAGES, "max_tokens": self.max_output},
                "admittedDigest": "sha256:admitted",
                "lease": {"fence": 1, "expiresAt": self._expiry()},
                "manifestId": "man-1",
            }
            self.admissions[key] = granted
            return 201, dict(granted)
        reservation = self.reservations[call.path.split("/")[4]]
        body = call.body
        if body.get("fence") != reservation.fence:
            return 409, problem(409, "STALE_FENCE")
        if call.action == "dispatch":
            if reservation.provider_request_id not in (None, body["providerRequestId"]):
                return 409, problem(409, "DISPATCH_CONFLICT")
            if reservation.provider_request_id is None and self.sim is not None:
                saw = self.sim.entry(body["providerRequestId"]) is not None
                reservation.provider_saw_it_before_dispatch = saw
            reservation.provider_request_id = body["providerRequestId"]
            reservation.state = "DISPATCHED"
        elif call.action == "usage":
            event_id = body["usageEventId"]
            if event_id in reservation.usage:
                same = reservation.usage[event_id] == body
                return (200, {"applied": False}) if same else (409, problem(409, "USAGE_CONFLICT"))
            reservation.usage[event_id] = body
            reservation.captured += body["outputTokens"]
            reservation.input_tokens = body.get("inputTokens", reservation.input_tokens)
            reservation.final = reservation.final or body["final"]
            reservation.state = "SETTLED" if body["final"] else "RUNNING"
        elif call.action == "lease":
            reservation.renewals += 1
            return 200, {"lease": {"fence": reservation.fence, "expiresAt": self._expiry()}}
        elif call.action in ("cancel", "fail"):
            reservation.terminal = {"action": call.action, **body}
        return 200, {"reservationId": reservation.reservation_id, "state": reservation.state}

    def _expiry(self) -> str:
        return (datetime.now(UTC) + timedelta(seconds=self.lease_ttl_s)).isoformat()


def problem(status: int, code: str) -> dict[str, Any]:
    return {"type": f"https://errors/{code}", "title": code, "status": status, "code": code, "detail": code}


@pytest.fixture
def sim() -> Iterator[Simulator]:
    simulator = Simulator(seed=5, max_words_per_chunk=3)
    simulator.start()
    yield simulator
    simulator.stop()


@pytest.fixture
def api(sim: Simulator) -> Iterator[FakeApi]:
    fake = FakeApi(sim)
    yield fake
    fake.stop()


def no_wait_retry(attempts: int = 4) -> RetryPolicy:
    return RetryPolicy(attempts=attempts, base_delay_s=0.0, max_delay_s=0.0, jitter=0.0)


def client_for(api: FakeApi, sim: Simulator, *, usage_every_chunks: int = 3, **kwargs: Any) -> GatewayClient:
    return GatewayClient(
        ApiClient(api.base_url, "svc-token", retry=no_wait_retry(), timeout_s=5),
        ChatProvider(sim.base_url + "/v1", "sk-provider", timeout_s=5),
        usage_every_chunks=usage_every_chunks,
        **kwargs,
    )


def usage_events(api: FakeApi) -> list[dict[str, Any]]:
    return list(api.only().usage.values())


# -- pure parts --------------------------------------------------------------------------------------------


def test_provider_request_id_is_stable_and_distinct_per_reservation() -> None:
    assert provider_request_id_for("r-1") == provider_request_id_for("r-1") == "tbr-r-1"
    assert provider_request_id_for("r-1") != provider_request_id_for("r-2")


def test_usage_event_ids_derive_from_the_provider_request_id_and_sequence() -> None:
    assert usage_event_id("tbr-r-1", 1) == "tbr-r-1:1"
    assert usage_event_id("tbr-r-1", 12) == "tbr-r-1:12"
    with pytest.raises(ValueError):
        usage_event_id("tbr-r-1", 0)


def test_backoff_doubles_up_to_the_cap_and_jitter_only_shortens() -> None:
    policy = RetryPolicy(attempts=6, base_delay_s=0.1, max_delay_s=0.5, jitter=0.2)
    assert [policy.backoff(retry, 0.0) for retry in range(1, 6)] == pytest.approx([0.1, 0.2, 0.4, 0.5, 0.5])
    assert policy.backoff(2, 0.999) == pytest.approx(0.2 * (1 - 0.2 * 0.999))
    assert all(0 < policy.backoff(r, 0.999) <= policy.backoff(r, 0.0) for r in range(1, 6))


@pytest.mark.parametrize(
    "kwargs",
    [{"attempts": 0}, {"base_delay_s": -1.0}, {"base_delay_s": 2.0, "max_delay_s": 1.0}, {"jitter": 1.5}],
)
def test_retry_policy_rejects_unusable_settings(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        RetryPolicy(**kwargs)


@pytest.mark.parametrize(
    ("status", "body", "retry"),
    [
        (502, None, True),
        (504, {"code": "X"}, True),
        (503, None, True),
        (503, {"title": "Service Unavailable"}, True),
        (503, {"code": "COUNTING_UNAVAILABLE"}, False),
        (500, None, False),
        (409, {"code": "STALE_FENCE"}, False),
        (429, {"code": "QUOTA_EXCEEDED"}, False),
    ],
)
def test_which_answers_are_retried(status: int, body: Any, retry: bool) -> None:
    assert is_retryable_status(status, body) is retry


def test_provider_body_caps_output_and_asks_for_usage() -> None:
    payload = {"model": "m", "messages": MESSAGES, "max_tokens": 500, "temperature": 0}
    body = provider_body(payload, 40, None)
    assert body["max_tokens"] == 40 and body["temperature"] == 0 and body["messages"] == MESSAGES
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert provider_body({"messages": MESSAGES, "max_tokens": 10}, 40, "fallback")["max_tokens"] == 10
    assert provider_body({"messages": MESSAGES}, 40, "fallback")["model"] == "fallback"
    assert (
        provider_body({"messages": MESSAGES, "max_completion_tokens": 99}, 40, "m")["max_completion_tokens"]
        == 40
    )
    assert payload["max_tokens"] == 500  # the admitted payload itself is not mutated


@pytest.mark.parametrize(
    "payload",
    [
        "a rendered string",
        {"model": "m"},
        {"messages": MESSAGES},
        {"model": "m", "messages": MESSAGES, "n": 2},
    ],
)
def test_provider_body_rejects_payloads_it_cannot_send(payload: Any) -> None:
    with pytest.raises(ProtocolViolation):
        provider_body(payload, 40, None)


def test_grant_requires_the_contract_fields() -> None:
    good = {
        "reservationId": "r-1",
        "payload": {"messages": MESSAGES},
        "admittedDigest": "sha256:x",
        "tokens": {"maxOutput": 40},
        "lease": {"fence": 3, "expiresAt": "2026-07-01T10:00:00Z"},
    }
    grant = Grant.from_response(ApiResponse(201, {"idempotent-replayed": "true"}, good))
    assert (grant.reservation_id, grant.fence, grant.max_output, grant.replayed) == ("r-1", 3, 40, True)
    for broken in (
        {k: v for k, v in good.items() if k != "admittedDigest"},
        {**good, "lease": {"fence": "3", "expiresAt": "2026-07-01T10:00:00Z"}},
        {**good, "lease": {"fence": True, "expiresAt": "2026-07-01T10:00:00Z"}},
        {**good, "lease": {"fence": 3, "expiresAt": "2026-07-01T10:00:00"}},
        {**good, "tokens": None},
    ):
        with pytest.raises(ProtocolViolation):
            Grant.from_response(ApiResponse(201, {}, broken))


# -- the API client's retries ------------------------------------------------------------------------------


def test_a_lost_answer_is_retried_with_the_same_idempotency_key_and_body(api: FakeApi) -> None:
    api.lose_response["admission"] = 2
    delays: list[float] = []
    client = ApiClient(
        api.base_url, "svc-token", retry=RetryPolicy(attempts=4, jitter=0.0), sleep=delays.append
    )
    response = client.request("POST", "/api/v1/admissions", ADMISSION, {"Idempotency-Key": "idem-1"})
    assert [c.headers["idempotency-key"] for c in api.calls] == ["idem-1"] * 3
    assert all(c.body == ADMISSION for c in api.calls)
    assert delays == [0.1, 0.2]
    # The first attempt was applied; the retry is a replay of it, not a second reservation.
    assert response.status == 200 and response.headers["idempotent-replayed"] == "true"
    assert len(api.reservations) == 1
    assert api.calls[0].headers["authorization"] == "Bearer svc-token"


def test_a_refused_connection_is_retried_then_reported_unavailable() -> None:
    fake = FakeApi()
    base_url = fake.base_url
    fake.stop()
    sleeps: list[float] = []
    client = ApiClient(base_url, "t", retry=RetryPolicy(attempts=3, jitter=0.0), sleep=sleeps.append)
    with pytest.raises(ApiUnavailable) as caught:
        client.request("POST", "/api/v1/admissions", ADMISSION, {"Idempotency-Key": "k"})
    assert "ConnectionRefusedError" in caught.value.cause
    assert not caught.value.reached, "no connection was made: nothing reached our API"
    assert sleeps == [0.1, 0.2]


def test_errors_are_not_retried_and_stale_fence_has_its_own_type(api: FakeApi) -> None:
    client = ApiClient(api.base_url, "t", retry=no_wait_retry())
    api.answer["admission"] = (429, problem(429, "QUOTA_EXCEEDED"))
    with pytest.raises(ApiError) as caught:
        client.request("POST", "/api/v1/admissions", ADMISSION, {"Idempotency-Key": "k"})
    assert caught.value.code == "QUOTA_EXCEEDED" and caught.value.status == 429
    assert not isinstance(caught.value, StaleFence)
    api.answer["lease"] = (409, problem(409, "STALE_FENCE"))
    with pytest.raises(StaleFence):
        client.request("POST", "/api/v1/reservations/r-1/lease", {"fence": 1})
    assert len(api.calls) == 2


def test_gateway_timeouts_are_retried(api: FakeApi) -> None:
    outcomes: Iterator[tuple[int, dict[str, Any]]] = iter([(504, {}), (502, {})])

    def flaky(fake: FakeApi, call: Call) -> None:
        fake.answer.pop("admission", None)
        canned = next(outcomes, None)
        if canned is not None:
            fake.answer["admission"] = canned

    api.before = flaky
    response = ApiClient(api.base_url, "t", retry=no_wait_retry()).request(
        "POST", "/api/v1/admissions", ADMISSION, {"Idempotency-Key": "k"}
    )
    assert response.status == 201 and len(api.calls) == 3


# -- whole calls against the simulator ---------------------------------------------------------------------


def test_completed_call_posts_deltas_that_sum_to_the_provider_bill(api: FakeApi, sim: Simulator) -> None:
    result = client_for(api, sim).run(ADMISSION, idempotency_key="idem-1")

    reservation = api.only()
    entry = sim.entry(result.provider_request_id)
    assert entry is not None and entry.status is BillingStatus.COMPLETED
    assert result.outcome == "completed" and result.provider_request_id == "tbr-r-1"
    assert reservation.provider_request_id == "tbr-r-1"
    assert reservation.provider_saw_it_before_dispatch is False
    assert api.actions()[:2] == ["admission", "dispatch"]
    assert api.calls[1].body == {
        "fence": 1,
        "providerRequestId": "tbr-r-1",
        "admittedDigest": "sha256:admitted",
    }
    events = usage_events(api)
    assert [e["usageEventId"] for e in events] == [f"tbr-r-1:{n}" for n in range(1, len(events) + 1)]
    assert [e["final"] for e in events] == [False] * (len(events) - 1) + [True]
    assert all(e["fence"] == 1 and e["outputTokens"] >= 0 for e in events)
    assert reservation.captured == entry.completion_tokens == result.output_tokens
    assert reservation.input_tokens == entry.prompt_tokens == events[-1]["inputTokens"]
    assert len(events) >= 3  # deltas were posted during the stream, not only at the end
    assert len(result.content.split()) == entry.completion_tokens
    assert entry.completion_tokens <= 40  # the provider was asked for at most the reserved output


def test_lost_usage_answers_are_retried_with_the_same_event_id(api: FakeApi, sim: Simulator) -> None:
    api.lose_response["usage"] = 3
    result = client_for(api, sim, usage_every_chunks=1).run(ADMISSION, idempotency_key="idem-1")
    usage_calls = [c.body for c in api.calls if c.action == "usage"]
    entry = sim.entry(result.provider_request_id)
    assert entry is not None
    assert len(usage_calls) == len(usage_events(api)) + 3
    assert api.only().captured == entry.completion_tokens


@pytest.mark.parametrize("fault", [Fault.DUPLICATE_USAGE, Fault.REORDER_USAGE])
def test_duplicated_or_reordered_usage_is_not_double_counted(
    api: FakeApi, sim: Simulator, fault: Fault
) -> None:
    sim.script(fault)
    result = client_for(api, sim, usage_every_chunks=1).run(ADMISSION, idempotency_key="idem-1")
    entry = sim.entry(result.provider_request_id)
    assert result.outcome == "completed" and entry is not None
    assert api.only().captured == entry.completion_tokens


def test_cut_stream_fails_with_request_sent_true_and_posts_only_a_lower_bound(
    api: FakeApi, sim: Simulator
) -> None:
    sim.script(Fault.CUT_AFTER_CHUNKS, after_chunks=7, completion_tokens=40)
    result = client_for(api, sim).run(ADMISSION, idempotency_key="idem-1")
    reservation = api.only()
    entry = sim.entry(result.provider_request_id)
    assert result.outcome == "failed" and result.request_sent is True
    assert reservation.terminal is not None and reservation.terminal["action"] == "fail"
    assert reservation.terminal["requestSent"] is True and "stream" in reservation.terminal["reason"]
    assert entry is not None and entry.status is BillingStatus.CUT
    assert 7 <= reservation.captured <= entry.completion_tokens
    assert not reservation.final
    assert api.actions()[-1] == "fail"


@pytest.mark.parametrize(
    ("fault", "request_sent"),
    [
        (Fault.RESET_BEFORE_READ, "unknown"),
        (Fault.RESET_AFTER_READ, "unknown"),
        (Fault.BILL_WITHOUT_ANSWER, "unknown"),
        (Fault.HTTP_5XX_AFTER_READ, True),
    ],
)
def test_provider_failures_report_what_is_known_about_sending(
    api: FakeApi, sim: Simulator, fault: Fault, request_sent: Any
) -> None:
    sim.script(fault)
    result = client_for(api, sim).run(ADMISSION, idempotency_key="idem-1")
    terminal = api.only().terminal
    assert result.outcome == "failed" and result.request_sent == request_sent
    assert terminal is not None and terminal["action"] == "fail" and terminal["requestSent"] == request_sent
    assert api.actions() == ["admission", "dispatch", "fail"]


@pytest.mark.parametrize(
    ("status", "error", "reason"),
    [
        (400, ("invalid_request_error", "context_length_exceeded"),
         "provider_http_400: invalid_request_error/context_length_exceeded"),
        (401, ("invalid_request_error", "invalid_api_key"),
         "provider_http_401: invalid_request_error/invalid_api_key"),
        (403, ("permission_error", None), "provider_http_403: permission_error"),
        (404, ("invalid_request_error", "model_not_found"),
         "provider_http_404: invalid_request_error/model_not_found"),
        (429, ("requests", "rate_limit_exceeded"), "provider_http_429: requests/rate_limit_exceeded"),
        (409, ("invalid_request_error", "duplicate_request_id"), None),
        (500, ("server_error", "server_error"), None),
        (422, None, None),
    ],
)  # fmt: skip
def test_provider_answers_documenting_non_processing_are_request_sent_false(
    api: FakeApi, status: int, error: tuple[str, str | None] | None, reason: str | None
) -> None:
    class Refusing(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            body = (
                {"error": {"message": "no", "type": error[0], "param": None, "code": error[1]}}
                if error is not None
                else {"detail": "not an OpenAI error body"}
            )
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    provider = ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
    thread = threading.Thread(target=provider.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        host, port = provider.server_address[:2]
        client = GatewayClient(
            ApiClient(api.base_url, "t", retry=no_wait_retry()),
            ChatProvider(f"http://{host!s}:{port}/v1", "sk"),
        )
        result = client.run(ADMISSION, idempotency_key="idem-1")
    finally:
        provider.shutdown()
        provider.server_close()
    terminal = api.only().terminal
    assert result.outcome == "failed" and terminal is not None and terminal["action"] == "fail"
    if reason is not None:
        # Documented non-processing: our API releases in full, input refunded.
        assert result.request_sent is False and terminal["requestSent"] is False
        assert terminal["reason"] == reason
    else:
        # A 5xx may follow processing, a 409 may mean an earlier attempt was processed: no proof.
        assert result.request_sent is True and terminal["requestSent"] is True
        assert terminal["reason"].startswith(f"provider_http_{status}: ")


def test_simulator_rate_limit_is_request_sent_false(api: FakeApi, sim: Simulator) -> None:
    sim.script(Fault.RATE_LIMITED)
    result = client_for(api, sim).run(ADMISSION, idempotency_key="idem-1")
    terminal = api.only().terminal
    assert result.request_sent is False and terminal is not None and terminal["requestSent"] is False
    entry = sim.entry(result.provider_request_id)
    assert entry is not None and entry.status is BillingStatus.FAILED_UNPROCESSED


def test_refused_provider_connection_is_request_sent_false(api: FakeApi) -> None:
    stopped = Simulator()
    provider_url = stopped.start()
    stopped.stop()
    client = GatewayClient(
        ApiClient(api.base_url, "t", retry=no_wait_retry()), ChatProvider(provider_url + "/v1", "sk")
    )
    result = client.run(ADMISSION, idempotency_key="idem-1")
    terminal = api.only().terminal
    assert result.outcome == "failed" and result.request_sent is False
    assert terminal is not None and terminal["requestSent"] is False and "connect" in terminal["reason"]


def test_missing_final_usage_is_reported_for_reconciliation(api: FakeApi, sim: Simulator) -> None:
    sim.script(Fault.OMIT_USAGE, completion_tokens=30)
    result = client_for(api, sim).run(ADMISSION, idempotency_key="idem-1")
    reservation = api.only()
    assert result.outcome == "usage_unknown" and len(result.content.split()) == 30
    assert reservation.terminal is not None and reservation.terminal["reason"] == "missing_final_usage"
    assert reservation.terminal["requestSent"] is True
    assert 0 < reservation.captured <= 30 and not reservation.final


def test_cancel_mid_stream_closes_the_stream_and_settles_what_was_seen(api: FakeApi, sim: Simulator) -> None:
    sim.script(completion_tokens=40, chunk_delay_s=0.01)

    class CancelAfter(threading.Event):
        def __init__(self, checks: int) -> None:
            super().__init__()
            self.checks = checks

        def is_set(self) -> bool:
            self.checks -= 1
            return self.checks < 0

    result = client_for(api, sim).run(ADMISSION, idempotency_key="idem-1", cancel=CancelAfter(5))
    reservation = api.only()
    assert result.outcome == "cancelled"
    assert reservation.terminal == {"action": "cancel", "fence": 1}
    assert api.actions()[-1] == "cancel"
    entry = sim.entry(result.provider_request_id)
    deadline = datetime.now(UTC) + timedelta(seconds=5)
    while entry is not None and entry.status is BillingStatus.RUNNING and datetime.now(UTC) < deadline:
        entry = sim.entry(result.provider_request_id)
    assert entry is not None and entry.status is BillingStatus.CUT
    assert reservation.captured <= entry.completion_tokens < 40


def test_cancel_before_dispatch_never_reaches_the_provider(api: FakeApi, sim: Simulator) -> None:
    cancel = threading.Event()
    cancel.set()
    result = client_for(api, sim).run(ADMISSION, idempotency_key="idem-1", cancel=cancel)
    assert result.outcome == "cancelled"
    assert api.actions() == ["admission", "cancel"]
    assert sim.entries() == []


def test_long_streams_renew_the_lease(sim: Simulator) -> None:
    sim.script(completion_tokens=40, chunk_delay_s=0.03)
    fake = FakeApi(sim, lease_ttl_s=0.3)
    try:
        result = client_for(fake, sim).run(ADMISSION, idempotency_key="idem-1")
        assert result.outcome == "completed"
        assert fake.only().renewals >= 2
        assert all(c.body == {"fence": 1} for c in fake.calls if c.action == "lease")
    finally:
        fake.stop()


def test_a_taken_over_lease_stops_the_client(api: FakeApi, sim: Simulator) -> None:
    sim.script(completion_tokens=40, chunk_delay_s=0.01)

    def reclaim_after_first_usage(fake: FakeApi, call: Call) -> None:
        if call.action == "usage" and fake.reservations:
            fake.only().fence = 2

    api.before = reclaim_after_first_usage
    with pytest.raises(StaleFence):
        client_for(api, sim).run(ADMISSION, idempotency_key="idem-1")
    assert api.actions() == ["admission", "dispatch", "usage"]
    entry = sim.entry("tbr-r-1")
    deadline = datetime.now(UTC) + timedelta(seconds=5)
    while entry is not None and entry.status is BillingStatus.RUNNING and datetime.now(UTC) < deadline:
        entry = sim.entry("tbr-r-1")
    assert entry is not None and entry.status is BillingStatus.CUT  # the provider stream was closed


def test_a_refused_dispatch_cancels_and_never_calls_the_provider(api: FakeApi, sim: Simulator) -> None:
    api.answer["dispatch"] = (409, problem(409, "ADMITTED_DIGEST_MISMATCH"))
    with pytest.raises(ApiError) as caught:
        client_for(api, sim).run(ADMISSION, idempotency_key="idem-1")
    assert caught.value.code == "ADMITTED_DIGEST_MISMATCH"
    assert api.actions() == ["admission", "dispatch", "cancel"]
    assert sim.entries() == []


def test_queued_and_rejected_admissions_raise(api: FakeApi, sim: Simulator) -> None:
    api.answer["admission"] = (
        202,
        {"state": "PROPOSED", "position": 3, "pollUrl": "/api/v1/reservations/r-9"},
    )
    with pytest.raises(AdmissionQueued) as queued:
        client_for(api, sim).run(ADMISSION, idempotency_key="idem-1")
    assert queued.value.body["position"] == 3
    api.answer["admission"] = (422, problem(422, "CONTEXT_BUDGET_EXCEEDED"))
    with pytest.raises(ApiError) as rejected:
        client_for(api, sim).run(ADMISSION, idempotency_key="idem-2")
    assert rejected.value.code == "CONTEXT_BUDGET_EXCEEDED"
    assert api.actions() == ["admission", "admission"] and sim.entries() == []


# -- a dying client ----------------------------------------------------------------------------------------


def test_dying_before_dispatch_leaves_only_the_admission(api: FakeApi, sim: Simulator) -> None:
    with pytest.raises(ClientDied):
        client_for(api, sim).run(ADMISSION, idempotency_key="idem-1", die_after="before_dispatch")
    assert api.actions() == ["admission"] and sim.entries() == []


def test_dying_after_dispatch_leaves_a_dispatch_the_provider_never_saw(api: FakeApi, sim: Simulator) -> None:
    with pytest.raises(ClientDied):
        client_for(api, sim).run(ADMISSION, idempotency_key="idem-1", die_after="dispatch")
    assert api.actions() == ["admission", "dispatch"] and sim.entries() == []


def test_dying_mid_stream_makes_no_further_calls(api: FakeApi, sim: Simulator) -> None:
    sim.script(completion_tokens=40)
    with pytest.raises(ClientDied):
        client_for(api, sim, usage_every_chunks=2).run(
            ADMISSION, idempotency_key="idem-1", die_after="after_k_chunks", die_after_chunks=4
        )
    assert api.actions() == ["admission", "dispatch", "usage", "usage"]
    assert not api.only().final and api.only().terminal is None


def test_dying_before_final_usage_leaves_the_provider_billed_and_us_unsettled(
    api: FakeApi, sim: Simulator
) -> None:
    with pytest.raises(ClientDied):
        client_for(api, sim).run(ADMISSION, idempotency_key="idem-1", die_after="before_final_usage")
    entry = sim.entry("tbr-r-1")
    assert entry is not None and entry.status is BillingStatus.COMPLETED
    assert api.actions()[-1] == "usage" and not api.only().final
    assert api.only().captured <= entry.completion_tokens
