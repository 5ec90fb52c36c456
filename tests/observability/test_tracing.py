"""Tracing: an admission's spans continue the gateway's trace, carry identifiers and answers but never the
request's text; tracing is off unless configured; the LiteLLM hook forwards the caller's ``traceparent``."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.instrumentation.django import DjangoInstrumentor
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.util._once import Once
from tokenbudget_gateway.transport import ApiResponse
from tokenbudget_litellm.calls import Calls
from tokenbudget_litellm.mapping import Caller, to_admission

from budgeting.catalog import snapshot
from budgeting.observability import tracing
from tests.api.test_admissions import request_body
from tests.integrations.test_litellm_calls import GRANT, ScriptedApi, run
from tests.integrations.test_litellm_mapping import GROUP, SETTINGS, request

TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
GATEWAY_SPAN_ID = 0x00F067AA0BA902B7
TRACEPARENT = f"00-{TRACE_ID:032x}-{GATEWAY_SPAN_ID:016x}-01"


def _set_global_provider(provider: trace.TracerProvider | None) -> None:
    # OpenTelemetry lets a process set its provider once; its own test utilities reset these globals the same
    # way, so the rest of the suite runs with tracing off again.
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    trace._TRACER_PROVIDER = None
    if provider is not None:
        trace.set_tracer_provider(provider)


@pytest.fixture
def read_catalog(demo_api):
    """The demo provisioned and this process's catalog snapshot current, as a serving process's is but right
    after a change (then an admission is decided again after the catalog read, and traced twice:
    tests/api/test_admission_cost.py)."""
    snapshot.current()
    return demo_api


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """Tracing on for one test, into memory: our spans and Django's (which reads ``traceparent``)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    _set_global_provider(provider)
    DjangoInstrumentor().instrument(tracer_provider=provider)
    try:
        yield exporter
    finally:
        DjangoInstrumentor().uninstrument()
        _set_global_provider(None)
        provider.shutdown()


def texts_of(value: Any) -> Iterator[str]:
    """Every string in a request body (its prompt text among them)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from texts_of(item)
    elif isinstance(value, list):
        for item in value:
            yield from texts_of(item)


def one(found: Sequence[ReadableSpan], name: str) -> ReadableSpan:
    matching = [span for span in found if span.name == name]
    assert len(matching) == 1, [span.name for span in found]
    return matching[0]


def parent_of(span: ReadableSpan) -> int | None:
    return None if span.parent is None else span.parent.span_id


@pytest.mark.django_db(transaction=True)
def test_an_admission_continues_the_gateways_trace_with_its_steps_as_spans(spans, read_catalog):
    demo_api = read_catalog
    body = request_body(requestId="trace-1")
    res = demo_api.post(
        "/api/v1/admissions",
        body,
        format="json",
        HTTP_IDEMPOTENCY_KEY="trace-1",
        HTTP_TRACEPARENT=TRACEPARENT,
    )
    assert res.status_code == 201, res.content[:300]
    answer = res.json()
    found = spans.get_finished_spans()

    assert {span.context.trace_id for span in found} == {TRACE_ID}
    (server,) = [span for span in found if span.kind == trace.SpanKind.SERVER]
    assert parent_of(server) == GATEWAY_SPAN_ID
    admission = one(found, "admission")
    assert parent_of(admission) == server.context.span_id
    ladder, reserve = one(found, "admission.ladder"), one(found, "admission.reserve")
    assert parent_of(ladder) == parent_of(reserve) == admission.context.span_id
    counts = [span for span in found if span.name == "admission.count"]
    assert counts, "a cold count cache makes the tokenizer count"
    assert {parent_of(span) for span in counts} == {ladder.context.span_id}

    assert admission.attributes == {
        "tokenbudget.tenant": "t-19",
        "tokenbudget.task_class": "contract-review",
        "tokenbudget.answer": answer["decision"],
        "tokenbudget.rung": answer["rung"],
    }
    assert ladder.attributes is not None and reserve.attributes is not None
    assert ladder.attributes["tokenbudget.rung"] == answer["rung"]
    assert ladder.attributes["tokenbudget.input_tokens"] == answer["tokens"]["input"]
    assert reserve.attributes["tokenbudget.state"] == "RESERVED"
    assert sum(int(span.attributes["tokenbudget.segments"]) for span in counts if span.attributes) > 0

    sent = [text for text in texts_of(body["components"]) if len(text) > 12]
    assert sent, "the request has text to look for"
    for span in found:
        values = [str(value) for value in (span.attributes or {}).values()]
        values += [str(value) for event in span.events for value in (event.attributes or {}).values()]
        assert not [text for text in sent if any(text in value for value in values)], span.name


@pytest.mark.django_db(transaction=True)
def test_a_refusal_is_an_answer_on_the_span_without_its_message(spans, read_catalog):
    demo_api = read_catalog
    body = request_body(requestId="trace-2", policyRevision=999)
    res = demo_api.post("/api/v1/admissions", body, format="json", HTTP_IDEMPOTENCY_KEY="trace-2")
    assert res.status_code == 409, res.content[:300]
    admission = one(spans.get_finished_spans(), "admission")
    assert admission.attributes is not None
    assert admission.attributes["tokenbudget.answer"] == res.json()["code"] == "POLICY_REVISION_MISMATCH"
    assert admission.events == ()
    assert admission.status.status_code == trace.StatusCode.UNSET


def test_tracing_is_off_unless_an_endpoint_or_tracing_1_is_configured():
    assert not tracing.enabled({})
    assert not tracing.enabled({"TRACING": "0"})
    assert tracing.enabled({"TRACING": "1"})
    assert tracing.enabled({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    assert tracing.enabled({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"})
    assert tracing.start({}) is False
    assert not isinstance(trace.get_tracer_provider(), TracerProvider)


def test_the_litellm_hook_forwards_the_callers_traceparent():
    data = request()
    data["proxy_server_request"] = {
        "headers": {"Traceparent": TRACEPARENT, "content-type": "application/json"}
    }
    admission = to_admission(data, GROUP, Caller(), SETTINGS)
    api = ScriptedApi(ApiResponse(201, {}, GRANT))
    run(Calls(api).admit(admission))
    assert api.sent[0].headers == {"Idempotency-Key": admission.idempotency_key, "traceparent": TRACEPARENT}

    untraced = to_admission(request(), GROUP, Caller(), SETTINGS)
    api = ScriptedApi(ApiResponse(201, {}, GRANT))
    run(Calls(api).admit(untraced))
    assert api.sent[0].headers == {"Idempotency-Key": untraced.idempotency_key}


def test_with_tracing_off_our_spans_are_not_recorded_and_with_it_on_they_are(spans):
    _set_global_provider(None)  # tracing off, as by default
    with tracing.span("admission", {"tokenbudget.tenant": "t-1"}) as off:
        off.set_attributes({"tokenbudget.rung": "FULL"})
        assert not off.is_recording()
    assert trace.get_current_span() is trace.INVALID_SPAN
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    _set_global_provider(provider)
    with tracing.span("admission", {"tokenbudget.tenant": "t-1"}) as on:
        assert on.is_recording() and trace.get_current_span() is on
    assert [s.name for s in spans.get_finished_spans()] == ["admission"]
