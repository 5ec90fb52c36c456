"""The provider simulator against the official OpenAI SDK and raw sockets. No database."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from reconciliation.providers.exports import parse_billing_export
from reconciliation.providers.records import BucketBillingRecord, RequestBillingRecord
from simulation.billing import BillingStatus, api_key_id
from simulation.completions import default_prompt_counter
from simulation.exports import parse_bucket_width
from simulation.faults import Fault
from simulation.provider import Simulator

MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "You review contracts."},
    {"role": "user", "content": "Summarise clause 7 of the master services agreement, please."},
]


# http.client sends the headers and the body separately; a reset that lands between them fails the body send
# with ECONNRESET or, if the kernel already processed the RST, EPIPE.
RESET = (ConnectionResetError, BrokenPipeError)


class FakeClock:
    """A settable UTC clock."""

    def __init__(self, start: datetime) -> None:
        self.now = start
        self._lock = threading.Lock()

    def __call__(self) -> datetime:
        with self._lock:
            return self.now

    def advance(self, delta: timedelta) -> None:
        with self._lock:
            self.now += delta


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(datetime(2026, 7, 1, 9, 59, 30, tzinfo=UTC))


@pytest.fixture
def sim(clock: FakeClock) -> Iterator[Simulator]:
    simulator = Simulator(seed=7, clock=clock, max_words_per_chunk=3)
    simulator.start()
    yield simulator
    simulator.stop()


def sdk(sim: Simulator, api_key: str = "sk-test", **kwargs: Any) -> openai.OpenAI:
    # The SDK retries connection errors and 5xx by default; a retry would reuse our request id and be
    # answered 409 by the simulator, so tests that provoke faults must see the first attempt only.
    return openai.OpenAI(api_key=api_key, base_url=sim.base_url + "/v1", max_retries=0, **kwargs)


def raw_post(
    sim: Simulator, body: dict[str, Any], headers: dict[str, str] | None = None, timeout: float = 5.0
) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    parts = urlsplit(sim.base_url)
    connection = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout)
    connection.request(
        "POST",
        "/v1/chat/completions",
        body=json.dumps(body).encode(),
        headers={"Authorization": "Bearer sk-test", "Content-Type": "application/json", **(headers or {})},
    )
    return connection, connection.getresponse()


def stream_body(max_tokens: int = 20, **extra: Any) -> dict[str, Any]:
    return {
        "model": "sim-large",
        "messages": MESSAGES,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }


def sse_events(response: http.client.HTTPResponse) -> list[Any]:
    """Read SSE ``data:`` payloads until ``[DONE]`` (returned as the string ``"[DONE]"``)."""
    events: list[Any] = []
    while True:
        line = response.readline()
        if not line:
            return events
        if line.startswith(b"data: "):
            payload = line[6:].strip().decode()
            events.append(payload if payload == "[DONE]" else json.loads(payload))
            if payload == "[DONE]":
                return events


def get_text(sim: Simulator, path: str) -> tuple[int, str]:
    parts = urlsplit(sim.base_url)
    connection = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=5)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read().decode()
    finally:
        connection.close()


def get_json(sim: Simulator, path: str) -> tuple[int, Any]:
    status, text = get_text(sim, path)
    return status, json.loads(text)


def wait_until_settled(sim: Simulator, request_id: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        entry = sim.entry(request_id)
        if entry is not None and entry.status is not BillingStatus.RUNNING:
            return
        time.sleep(0.01)
    raise AssertionError(f"{request_id} still running")


# -- the protocol, through the official SDK ----------------------------------------------------------------


def test_sdk_stream_yields_content_and_final_usage_equal_to_the_ledger(sim: Simulator) -> None:
    stream = sdk(sim).chat.completions.create(
        model="sim-large",
        messages=MESSAGES,
        max_tokens=40,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"X-Request-Id": "prq-sdk-1"},
    )
    chunks = list(stream)

    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    text = "".join(c.choices[0].delta.content or "" for c in content_chunks)
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert [c.id for c in chunks] == ["prq-sdk-1"] * len(chunks)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1] and chunks[-1].choices == []
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish in (["stop"], ["length"])

    usage = usage_chunks[0].usage
    entry = sim.entry("prq-sdk-1")
    assert usage is not None and entry is not None
    assert entry.status is BillingStatus.COMPLETED
    assert (usage.prompt_tokens, usage.completion_tokens) == (entry.prompt_tokens, entry.completion_tokens)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens == default_prompt_counter(MESSAGES)
    # One word is one token, and every content chunk carries at least one.
    assert len(text.split()) == usage.completion_tokens
    assert 20 <= usage.completion_tokens <= 40
    assert len(content_chunks) <= usage.completion_tokens


def test_sdk_non_streaming_answer_matches_the_ledger(sim: Simulator) -> None:
    completion = sdk(sim).chat.completions.create(
        model="sim-large",
        messages=MESSAGES,
        max_tokens=12,
        extra_headers={"X-Request-Id": "prq-plain"},
    )
    entry = sim.entry("prq-plain")
    assert completion.id == "prq-plain" and completion.object == "chat.completion"
    assert completion.usage is not None and entry is not None
    assert completion.usage.completion_tokens == entry.completion_tokens
    assert completion.usage.prompt_tokens == entry.prompt_tokens
    assert len((completion.choices[0].message.content or "").split()) == entry.completion_tokens


def test_without_include_usage_there_is_no_usage_chunk_but_the_request_is_billed(sim: Simulator) -> None:
    chunks = list(
        sdk(sim).chat.completions.create(
            model="sim-large",
            messages=MESSAGES,
            max_tokens=10,
            stream=True,
            extra_headers={"X-Request-Id": "prq-nousage"},
        )
    )
    entry = sim.entry("prq-nousage")
    assert all(c.usage is None for c in chunks)
    assert entry is not None and entry.status is BillingStatus.COMPLETED and entry.completion_tokens >= 5


def test_generated_request_id_is_echoed_and_used_in_the_ledger(sim: Simulator) -> None:
    completion = sdk(sim).chat.completions.create(model="m", messages=MESSAGES, max_tokens=3)
    assert completion.id.startswith("chatcmpl-")
    assert sim.entry(completion.id) is not None


def test_idempotency_key_header_is_honoured(sim: Simulator) -> None:
    connection, response = raw_post(sim, {**stream_body(), "stream": False, "stream_options": None},
                                    {"Idempotency-Key": "idem-1"})  # fmt: skip
    body = json.loads(response.read())
    connection.close()
    assert body["id"] == "idem-1" and response.getheader("x-request-id") == "idem-1"


def test_a_reused_request_id_is_refused_and_not_billed_twice(sim: Simulator) -> None:
    client = sdk(sim)
    client.chat.completions.create(
        model="m",
        messages=MESSAGES,
        max_tokens=5,
        extra_headers={"X-Request-Id": "prq-dup"},
    )
    before = sim.entry("prq-dup")
    with pytest.raises(openai.ConflictError):
        client.chat.completions.create(
            model="m",
            messages=MESSAGES,
            max_tokens=5,
            extra_headers={"X-Request-Id": "prq-dup"},
        )
    assert sim.entry("prq-dup") == before


def test_output_is_deterministic_per_seed_and_request_id(clock: FakeClock) -> None:
    def answer(seed: int) -> str:
        with Simulator(seed=seed, clock=clock) as simulator:
            completion = sdk(simulator).chat.completions.create(
                model="m",
                messages=MESSAGES,
                max_tokens=30,
                extra_headers={"X-Request-Id": "same-id"},
            )
            return completion.choices[0].message.content or ""

    assert answer(1) == answer(1)
    assert answer(1) != answer(2)


def test_prompt_counter_is_pluggable(clock: FakeClock) -> None:
    with Simulator(clock=clock, prompt_counter=lambda messages: 1000 + len(messages)) as simulator:
        completion = sdk(simulator).chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
    assert completion.usage is not None and completion.usage.prompt_tokens == 1002


def test_default_prompt_counter_counts_utf8_bytes_and_text_parts() -> None:
    assert default_prompt_counter([{"role": "user", "content": "abcdefgh"}]) == 2 + 4
    assert default_prompt_counter([{"role": "user", "content": "契約"}]) == 6 // 4 + 4
    parts = [{"type": "text", "text": "abcd"}, {"type": "image_url", "image_url": {"url": "x"}}]
    assert default_prompt_counter([{"role": "user", "content": parts}]) == 1 + 4


def test_completion_tokens_can_be_fixed_and_finish_reason_reflects_the_limit(sim: Simulator) -> None:
    sim.script(completion_tokens=9)
    sim.script(completion_tokens=50)
    client = sdk(sim)
    short = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=20)
    capped = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=20)
    assert short.usage is not None and short.usage.completion_tokens == 9
    assert short.choices[0].finish_reason == "stop"
    assert capped.usage is not None and capped.usage.completion_tokens == 20
    assert capped.choices[0].finish_reason == "length"


def test_context_overflow_is_refused_and_not_billed(clock: FakeClock) -> None:
    with Simulator(clock=clock, context_windows={"tiny": 30}) as simulator:
        with pytest.raises(openai.BadRequestError) as caught:
            sdk(simulator).chat.completions.create(
                model="tiny",
                messages=MESSAGES,
                max_tokens=20,
                extra_headers={"X-Request-Id": "prq-overflow"},
            )
        assert caught.value.code == "context_length_exceeded"
        entry = simulator.entry("prq-overflow")
        assert entry is not None and entry.status is BillingStatus.FAILED_UNPROCESSED and not entry.billed
        assert get_json(simulator, "/v1/requests/prq-overflow")[1]["status"] == "not_found"


def test_rate_limited_request_is_refused_with_429_and_not_billed(sim: Simulator) -> None:
    sim.script(Fault.RATE_LIMITED)
    with pytest.raises(openai.RateLimitError) as caught:
        sdk(sim).chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=5, extra_headers={"X-Request-Id": "prq-429"}
        )
    assert caught.value.status_code == 429 and caught.value.code == "rate_limit_exceeded"
    entry = sim.entry("prq-429")
    assert entry is not None and entry.status is BillingStatus.FAILED_UNPROCESSED and not entry.billed
    assert get_json(sim, "/v1/requests/prq-429")[1]["status"] == "not_found"
    # Refused before any work, so the same id may be sent again and is then processed once.
    sdk(sim).chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=5, extra_headers={"X-Request-Id": "prq-429"}
    )
    retried = sim.entry("prq-429")
    assert retried is not None and retried.status is BillingStatus.COMPLETED


def test_requests_without_a_bearer_token_or_with_bad_bodies_are_refused_unbilled(sim: Simulator) -> None:
    parts = urlsplit(sim.base_url)
    connection = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=5)
    connection.request("POST", "/v1/chat/completions", body=b"{}", headers={"X-Request-Id": "no-auth"})
    assert connection.getresponse().status == 401
    connection.close()
    connection, response = raw_post(sim, {"model": "m", "messages": []}, {"X-Request-Id": "empty"})
    assert response.status == 400
    connection.close()
    assert sim.entries() == []


# -- faults, observed on the wire --------------------------------------------------------------------------


def test_delay_fault_delays_the_answer(sim: Simulator) -> None:
    sim.script(Fault.DELAY, delay_s=0.3)
    started = time.monotonic()
    sdk(sim).chat.completions.create(model="m", messages=MESSAGES, max_tokens=3)
    assert time.monotonic() - started >= 0.3


def test_a_delayed_request_is_already_running_for_lookups(sim: Simulator) -> None:
    sim.script(Fault.DELAY, delay_s=0.3)
    worker = threading.Thread(
        target=lambda: sse_events(raw_post(sim, stream_body(), {"X-Request-Id": "prq-d"})[1])
    )
    worker.start()
    try:
        while sim.entry("prq-d") is None:
            time.sleep(0.005)
        assert get_json(sim, "/v1/requests/prq-d")[1]["status"] == "running"
    finally:
        worker.join()
    assert get_json(sim, "/v1/requests/prq-d")[1]["status"] == "completed"


def test_reset_before_read_resets_and_bills_nothing(sim: Simulator) -> None:
    sim.script(Fault.RESET_BEFORE_READ)
    with pytest.raises(RESET) as caught:
        raw_post(sim, stream_body(), {"X-Request-Id": "prq-rbr"})
    assert not isinstance(caught.value, http.client.RemoteDisconnected)  # a reset, not a clean close
    entry = sim.entry("prq-rbr")
    assert entry is not None and entry.status is BillingStatus.FAILED_UNPROCESSED
    assert (entry.prompt_tokens, entry.completion_tokens) == (0, 0)
    assert get_json(sim, "/v1/requests/prq-rbr")[1]["status"] == "not_found"
    assert "prq-rbr" not in sim.billing_export("csv")


def test_a_never_processed_id_may_be_used_again(sim: Simulator) -> None:
    sim.script(Fault.RESET_BEFORE_READ)
    with pytest.raises(RESET):
        raw_post(sim, stream_body(), {"X-Request-Id": "prq-again"})
    completion = sdk(sim).chat.completions.create(
        model="m",
        messages=MESSAGES,
        max_tokens=4,
        extra_headers={"X-Request-Id": "prq-again"},
    )
    entry = sim.entry("prq-again")
    assert completion.usage is not None and entry is not None and entry.status is BillingStatus.COMPLETED


def test_reset_after_read_bills_the_prompt(sim: Simulator) -> None:
    sim.script(Fault.RESET_AFTER_READ)
    with pytest.raises(RESET) as caught:
        raw_post(sim, stream_body(), {"X-Request-Id": "prq-rar"})
    assert not isinstance(caught.value, http.client.RemoteDisconnected)
    entry = sim.entry("prq-rar")
    assert entry is not None and entry.status is BillingStatus.CUT
    assert entry.prompt_tokens == default_prompt_counter(MESSAGES) and entry.completion_tokens == 0
    status, body = get_json(sim, "/v1/requests/prq-rar")
    assert status == 200 and body["status"] == "completed"
    assert body["usage"]["prompt_tokens"] == entry.prompt_tokens


def test_5xx_after_read_answers_the_error_and_bills_the_prompt(sim: Simulator) -> None:
    sim.script(Fault.HTTP_5XX_AFTER_READ, status_code=503)
    with pytest.raises(openai.InternalServerError) as caught:
        sdk(sim).chat.completions.create(
            model="m",
            messages=MESSAGES,
            extra_headers={"X-Request-Id": "prq-503"},
        )
    assert caught.value.status_code == 503
    entry = sim.entry("prq-503")
    assert entry is not None and entry.status is BillingStatus.CUT and entry.billed
    assert entry.prompt_tokens > 0 and entry.completion_tokens == 0


def test_cut_after_chunks_resets_after_k_chunks_and_bills_what_was_produced(sim: Simulator) -> None:
    sim.script(Fault.CUT_AFTER_CHUNKS, after_chunks=3, completion_tokens=30)
    connection, response = raw_post(sim, stream_body(max_tokens=30), {"X-Request-Id": "prq-cut"})
    assert response.status == 200
    events: list[dict[str, Any]] = []
    with pytest.raises((*RESET, http.client.IncompleteRead)):
        while line := response.readline():
            if line.startswith(b"data: "):
                events.append(json.loads(line[6:]))
    connection.close()
    content = [e["choices"][0]["delta"]["content"] for e in events if e["choices"][0]["delta"].get("content")]
    assert len(content) == 3
    entry = sim.entry("prq-cut")
    assert entry is not None and entry.status is BillingStatus.CUT
    assert entry.completion_tokens == len("".join(content).split()) < 30


def test_omit_usage_completes_without_the_usage_chunk_and_bills_in_full(sim: Simulator) -> None:
    sim.script(Fault.OMIT_USAGE, completion_tokens=12)
    chunks = list(
        sdk(sim).chat.completions.create(
            model="m",
            messages=MESSAGES,
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers={"X-Request-Id": "prq-omit"},
        )
    )
    assert all(c.usage is None for c in chunks)
    entry = sim.entry("prq-omit")
    assert entry is not None and entry.status is BillingStatus.COMPLETED and entry.completion_tokens == 12


def test_duplicate_usage_sends_the_usage_chunk_twice(sim: Simulator) -> None:
    sim.script(Fault.DUPLICATE_USAGE)
    connection, response = raw_post(sim, stream_body(), {"X-Request-Id": "prq-dupusage"})
    events = sse_events(response)
    connection.close()
    usage_events = [e for e in events if isinstance(e, dict) and e.get("usage")]
    entry = sim.entry("prq-dupusage")
    assert len(usage_events) == 2 and usage_events[0] == usage_events[1] and events[-1] == "[DONE]"
    assert entry is not None and usage_events[0]["usage"]["completion_tokens"] == entry.completion_tokens


def test_per_chunk_usage_is_cumulative_and_reorder_swaps_adjacent_reports(clock: FakeClock) -> None:
    with Simulator(seed=3, clock=clock, per_chunk_usage=True) as simulator:
        simulator.script(completion_tokens=20)
        simulator.script(Fault.REORDER_USAGE, completion_tokens=20)
        reports = []
        for request_id in ("in-order", "reordered"):
            connection, response = raw_post(simulator, stream_body(), {"X-Request-Id": request_id})
            events = [e for e in sse_events(response) if isinstance(e, dict)]
            connection.close()
            reports.append([e["usage"]["completion_tokens"] for e in events if e["choices"]])
        in_order, reordered = reports
        assert in_order == sorted(in_order) and in_order[0] == 0
        assert reordered != sorted(reordered)
        assert max(reordered) == max(in_order) == 20
        entry = simulator.entry("reordered")
        assert entry is not None and entry.completion_tokens == 20


def test_continuous_usage_stats_turns_per_chunk_usage_on_per_request(sim: Simulator) -> None:
    body = stream_body(stream_options={"include_usage": True, "continuous_usage_stats": True})
    connection, response = raw_post(sim, body, {"X-Request-Id": "prq-cont"})
    events = [e for e in sse_events(response) if isinstance(e, dict)]
    connection.close()
    assert all(e["usage"] is not None for e in events)


def test_bill_without_answer_closes_cleanly_and_bills_in_full(sim: Simulator) -> None:
    sim.script(Fault.BILL_WITHOUT_ANSWER, completion_tokens=15)
    with pytest.raises(http.client.RemoteDisconnected):
        raw_post(sim, stream_body(), {"X-Request-Id": "prq-silent"})
    entry = sim.entry("prq-silent")
    assert entry is not None and entry.status is BillingStatus.COMPLETED and entry.completion_tokens == 15
    assert get_json(sim, "/v1/requests/prq-silent")[1]["usage"]["completion_tokens"] == 15


def test_a_client_that_disconnects_is_billed_for_what_was_produced(sim: Simulator) -> None:
    sim.script(completion_tokens=60, chunk_delay_s=0.02)
    connection, response = raw_post(sim, stream_body(max_tokens=60), {"X-Request-Id": "prq-gone"})
    for _ in range(3):
        response.readline()
    assert connection.sock is not None
    connection.sock.close()
    connection.close()
    wait_until_settled(sim, "prq-gone")
    entry = sim.entry("prq-gone")
    assert entry is not None and entry.status is BillingStatus.CUT and 0 < entry.completion_tokens < 60


def test_fault_header_applies_to_that_request_only(sim: Simulator) -> None:
    with pytest.raises(RESET):
        raw_post(sim, stream_body(), {"X-Request-Id": "hdr-1", "X-Sim-Fault": "reset_after_read"})
    connection, response = raw_post(sim, stream_body(), {"X-Request-Id": "hdr-2"})
    sse_events(response)
    connection.close()
    entry = sim.entry("hdr-2")
    assert entry is not None and entry.status is BillingStatus.COMPLETED

    connection, response = raw_post(sim, stream_body(), {"X-Sim-Fault": "cut_after_chunks;after_chunks=x"})
    assert response.status == 400
    connection.close()


def test_scripts_apply_to_the_next_n_requests_and_request_id_scripts_win(sim: Simulator) -> None:
    sim.script(Fault.RESET_AFTER_READ, count=2)
    sim.script(Fault.BILL_WITHOUT_ANSWER, request_id="special")
    with pytest.raises(http.client.RemoteDisconnected):
        raw_post(sim, stream_body(), {"X-Request-Id": "special"})
    for request_id in ("a", "b"):
        with pytest.raises(RESET):
            raw_post(sim, stream_body(), {"X-Request-Id": request_id})
    connection, response = raw_post(sim, stream_body(), {"X-Request-Id": "c"})
    assert sse_events(response)[-1] == "[DONE]"
    connection.close()


def test_script_parameters_are_validated(sim: Simulator) -> None:
    with pytest.raises(ValueError):
        sim.script("no_such_fault")
    with pytest.raises(ValueError):
        sim.script(Fault.DELAY)
    with pytest.raises(ValueError):
        sim.script(Fault.HTTP_5XX_AFTER_READ, status_code=404)
    with pytest.raises(ValueError):
        sim.script(count=0)


# -- lookups and exports -----------------------------------------------------------------------------------


def test_lookup_reports_running_then_completed(sim: Simulator) -> None:
    sim.script(completion_tokens=40, chunk_delay_s=0.02)
    connection, response = raw_post(sim, stream_body(max_tokens=40), {"X-Request-Id": "prq-slow"})
    response.readline()
    status, running = get_json(sim, "/v1/requests/prq-slow")
    assert status == 200 and running["status"] == "running"
    sse_events(response)
    connection.close()
    _, done = get_json(sim, "/v1/requests/prq-slow")
    assert done["status"] == "completed" and done["usage"]["completion_tokens"] == 40
    assert get_json(sim, "/v1/requests/never-seen")[1] == {
        "id": "never-seen",
        "status": "not_found",
        "usage": None,
        "model": None,
    }


def _make_requests(sim: Simulator, clock: FakeClock) -> None:
    plan = [("sk-a", "model-x"), ("sk-a", "model-y"), ("sk-b", "model-x"), ("sk-a", "model-x")]
    for index in range(12):
        api_key, model = plan[index % len(plan)]
        sdk(sim, api_key=api_key).chat.completions.create(
            model=model,
            messages=MESSAGES,
            max_tokens=5 + index,
            extra_headers={"X-Request-Id": f"prq-{index:02d}"},
        )
        clock.advance(timedelta(minutes=13))
    # Unbilled and running rows must stay out of exports.
    sim.script(Fault.RESET_BEFORE_READ)
    with pytest.raises(RESET):
        raw_post(sim, stream_body(), {"X-Request-Id": "prq-unbilled"})


def test_csv_and_jsonl_exports_parse_and_buckets_sum_to_the_requests(
    sim: Simulator, clock: FakeClock
) -> None:
    _make_requests(sim, clock)
    billed = {e.request_id: e for e in sim.entries() if e.billed}
    assert len(billed) == 12

    for fmt in ("csv", "jsonl"):
        status, text = get_text(sim, f"/v1/billing/export?format={fmt}&granularity=request")
        assert status == 200 and text == sim.billing_export(fmt)
        parsed = parse_billing_export(text, fmt)
        requests = [r for r in parsed if isinstance(r, RequestBillingRecord)]
        assert len(requests) == len(parsed)
        assert {r.request_id: (r.input_tokens, r.output_tokens) for r in requests} == {
            request_id: (e.prompt_tokens, e.completion_tokens) for request_id, e in billed.items()
        }
        assert all(r.start_time == billed[r.request_id].started_at for r in requests)

        parsed = parse_billing_export(sim.billing_export(fmt, "bucket", timedelta(hours=1)), fmt)
        buckets = [b for b in parsed if isinstance(b, BucketBillingRecord)]
        assert len(buckets) == len(parsed)
        sums: dict[tuple[Any, ...], list[int | None]] = {}
        for record in requests:
            start = record.start_time.replace(minute=0, second=0, microsecond=0)
            key = (record.api_key_id, record.project_id, record.model, start)
            prompt, completion, count = sums.get(key, [0, 0, 0])
            assert prompt is not None and completion is not None and count is not None
            sums[key] = [prompt + record.input_tokens, completion + record.output_tokens, count + 1]
        assert {
            (b.api_key_id, b.project_id, b.model, b.bucket_start): [
                b.input_tokens,
                b.output_tokens,
                b.num_model_requests,
            ]
            for b in buckets
        } == sums
        assert len({b.bucket_start for b in buckets}) >= 3
        assert {b.api_key_id for b in buckets} == {api_key_id("sk-a"), api_key_id("sk-b")}


def test_export_endpoint_serves_both_formats_and_filters_by_time(sim: Simulator, clock: FakeClock) -> None:
    _make_requests(sim, clock)
    parts = urlsplit(sim.base_url)
    connection = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=5)
    window = "start_time=2026-07-01T10:00:00Z&end_time=2026-07-01T11:00:00Z"
    connection.request("GET", f"/v1/billing/export?format=jsonl&granularity=request&{window}")
    response = connection.getresponse()
    text = response.read().decode()
    assert response.getheader("Content-Type") == "application/x-ndjson"
    records = parse_billing_export(text, "jsonl")
    assert records and all(isinstance(r, RequestBillingRecord) and r.start_time.hour == 10 for r in records)

    connection.request("GET", "/v1/billing/export?format=csv&granularity=bucket&bucket=1d")
    response = connection.getresponse()
    day = parse_billing_export(response.read().decode(), "csv")
    assert all(isinstance(r, BucketBillingRecord) for r in day)
    assert sum(r.output_tokens for r in day if isinstance(r, BucketBillingRecord)) == sum(
        e.completion_tokens for e in sim.entries()
    )

    for bad in ("format=xml", "granularity=hourly", "bucket=1w", "start_time=yesterday"):
        connection.request("GET", f"/v1/billing/export?{bad}")
        response = connection.getresponse()
        response.read()
        assert response.status == 400, bad
    connection.close()


def test_bucket_width_parsing() -> None:
    assert parse_bucket_width("1h") == timedelta(hours=1)
    assert parse_bucket_width("15m") == timedelta(minutes=15)
    assert parse_bucket_width("1d") == timedelta(days=1)
    for bad in ("0h", "h", "1w", "1.5h", ""):
        with pytest.raises(ValueError):
            parse_bucket_width(bad)


def test_stop_refuses_new_connections_and_is_idempotent(clock: FakeClock) -> None:
    simulator = Simulator(clock=clock)
    base_url = simulator.start()
    simulator.stop()
    simulator.stop()
    parts = urlsplit(base_url)
    with pytest.raises(ConnectionRefusedError):
        http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=2).connect()


def test_stop_aborts_a_stream_in_flight(clock: FakeClock) -> None:
    simulator = Simulator(clock=clock)
    simulator.start()
    simulator.script(completion_tokens=200, chunk_delay_s=0.05)
    connection, response = raw_post(simulator, stream_body(max_tokens=200), {"X-Request-Id": "prq-stop"})
    response.readline()
    simulator.stop()
    wait_until_settled(simulator, "prq-stop")
    entry = simulator.entry("prq-stop")
    connection.close()
    assert entry is not None and entry.status is BillingStatus.CUT


def test_compare_matches_settled_usage_against_the_billing_ledger(sim: Simulator) -> None:
    client = sdk(sim)
    client.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=6, extra_headers={"X-Request-Id": "prq-ok"}
    )
    client.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=6, extra_headers={"X-Request-Id": "prq-wrong"}
    )
    client.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=6, extra_headers={"X-Request-Id": "prq-open"}
    )
    sim.script(Fault.RESET_BEFORE_READ)
    with pytest.raises(RESET):
        raw_post(sim, stream_body(), {"X-Request-Id": "prq-unprocessed"})
    ok, wrong = sim.entry("prq-ok"), sim.entry("prq-wrong")
    assert ok is not None and wrong is not None
    comparison = sim.compare(
        {
            "prq-ok": (ok.prompt_tokens, ok.completion_tokens),
            "prq-wrong": (wrong.prompt_tokens, wrong.completion_tokens - 1),
            "prq-unprocessed": (0, 0),
            "prq-never-sent": (0, 0),
        }
    )
    assert [(m.request_id, m.billed) for m in comparison.mismatches] == [
        ("prq-wrong", (wrong.prompt_tokens, wrong.completion_tokens))
    ]
    assert comparison.unsettled == ("prq-open",), "billed, but nothing of ours settled it"
    assert comparison.compared == 4 and not comparison.ok
    assert comparison.billed_input == 3 * ok.prompt_tokens
    assert sim.compare({"prq-ok": (ok.prompt_tokens, ok.completion_tokens + 1)}).mismatches[0].settled == (
        ok.prompt_tokens,
        ok.completion_tokens + 1,
    )


def test_compare_never_matches_a_request_still_running(sim: Simulator) -> None:
    sim.script(Fault.DELAY, delay_s=0.5)
    worker = threading.Thread(target=lambda: raw_post(sim, stream_body(), {"X-Request-Id": "prq-running"}))
    worker.start()
    try:
        deadline = time.monotonic() + 5
        while sim.entry("prq-running") is None and time.monotonic() < deadline:
            time.sleep(0.01)
        running = sim.entry("prq-running")
        assert running is not None and running.status is BillingStatus.RUNNING
        comparison = sim.compare({"prq-running": (running.prompt_tokens, 0)})
        assert [m.request_id for m in comparison.mismatches] == ["prq-running"], "its bill is not final"
    finally:
        worker.join()


# -- the wire ----------------------------------------------------------------------------------------------


def _nodelay_of_open_connections(server: Any) -> list[int]:
    with server._connections_lock:
        return [c.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for c in server._connections]


def test_the_simulator_sends_its_answers_without_waiting_for_the_clients_ack(sim: Simulator) -> None:
    """With Nagle's algorithm on, an answer's body (written after its headers) waited for the client's
    delayed ACK, ~40 ms, so every zero-delay call through the simulator took ~50 ms: no real provider
    does that, and it hid what a gateway adds to a call. The check reads the server side of a kept-alive
    connection; a socket accepted without the handler's setup (the negative control) has Nagle on."""
    connection, response = raw_post(sim, {"model": "sim-large", "messages": MESSAGES, "max_tokens": 5})
    try:
        response.read()
        assert _nodelay_of_open_connections(sim._server) == [1]
    finally:
        connection.close()

    # The negative control: a socket accepted as socketserver accepts it, without the handler's setup.
    listener = socket.create_server(("127.0.0.1", 0))
    with listener, socket.create_connection(listener.getsockname()[:2]):
        accepted, _ = listener.accept()
        with accepted:
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 0


def test_a_model_with_its_own_counter_is_billed_its_prompt_tokens_and_the_others_the_estimate(
    clock: FakeClock,
) -> None:
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "How do I reset my password?"}]
    sim = Simulator(clock=clock, model_counters={"counted@1": lambda sent: 1000 + len(sent)})
    sim.start()
    try:
        client = sdk(sim)
        counted = client.chat.completions.create(model="counted@1", messages=messages, max_tokens=5)
        other = client.chat.completions.create(model="other@1", messages=messages, max_tokens=5)
    finally:
        sim.stop()
    assert counted.usage is not None and counted.usage.prompt_tokens == 1001
    assert other.usage is not None and other.usage.prompt_tokens == default_prompt_counter(messages)
