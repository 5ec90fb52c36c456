"""OpenTelemetry tracing: the tracer of admission's spans, and starting export only when it is configured.

Off by default: without ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) or
``TRACING=1`` nothing is installed, the global tracer provider stays OpenTelemetry's no-op, and a span costs
a context switch and no I/O. When on, spans go to an OTLP/HTTP collector (the standard ``OTEL_*`` variables
configure it; ``TRACING=1`` alone sends to the default ``http://localhost:4318``) and Django, psycopg, Redis
and Celery are instrumented; a ``traceparent`` header on a request continues the caller's trace.

Span attributes name the tenant, task class, rung and answer; never the request's text.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext

from opentelemetry import trace
from opentelemetry.trace import Span
from opentelemetry.util.types import AttributeValue

from ladder.counting import CountMethod, SegmentCounter

logger = logging.getLogger(__name__)

TRACER_NAME = "budgeting"
SERVICE_NAME = "token-budget-admission"

_started = False


def tracer() -> trace.Tracer:
    """The tracer of our own spans, looked up on each use so a provider installed later (or by a test) is
    the one that records them."""
    return trace.get_tracer(TRACER_NAME)


def span(name: str, attributes: Mapping[str, AttributeValue] | None = None) -> AbstractContextManager[Span]:
    """A span of ours, current while it is open. An exception passing through is neither recorded on it nor
    made its status: a refusal's message may quote the request, and a refusal is an answer, not a fault.

    With no tracer provider installed (tracing off, the default), OpenTelemetry would build and attach a
    non-recording span for nothing (measured: bench/README.md): the
    invalid span is answered instead, and what is set on it is dropped alike."""
    if isinstance(trace.get_tracer_provider(), _NOT_RECORDING):
        return _NO_SPAN
    return tracer().start_as_current_span(
        name, attributes=attributes, record_exception=False, set_status_on_exception=False
    )


_NOT_RECORDING = (trace.ProxyTracerProvider, trace.NoOpTracerProvider)
_NO_SPAN = nullcontext(trace.INVALID_SPAN)


class TracedCounter:
    """A model's counter whose tokenizer work (the segments the count cache did not have) is a ``count``
    span: the ladder itself is pure and knows nothing of tracing."""

    def __init__(self, counter: SegmentCounter) -> None:
        self._counter = counter

    @property
    def digest(self) -> str:
        return self._counter.digest

    @property
    def method(self) -> CountMethod:
        return self._counter.method

    def count_many(self, texts: Sequence[str]) -> list[int]:
        with span("admission.count") as current:
            counts = self._counter.count_many(texts)
            current.set_attributes(
                {
                    "tokenbudget.segments": len(texts),
                    "tokenbudget.tokens": sum(counts),
                    "tokenbudget.method": self.method,
                }
            )
            return counts


def enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this process exports traces: an OTLP endpoint is configured, or ``TRACING=1``."""
    endpoint = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    return bool(endpoint) or environ.get("TRACING") == "1"


def start(environ: Mapping[str, str] = os.environ) -> bool:
    """Install the exporting tracer provider and the instrumentations if tracing is configured; once per
    process (later calls do nothing). Returns whether tracing is on.

    Call it before Django loads its middleware (the Django instrumentation adds its own), i.e. before
    ``get_wsgi_application()``, and in each Celery worker process.
    """
    global _started
    if _started:
        return True
    if not enabled(environ):
        return False
    # Imported here: a process with tracing off never loads the SDK, the exporter or the instrumentations.
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({"service.name": environ.get("OTEL_SERVICE_NAME") or SERVICE_NAME})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    instrument()
    _started = True
    logger.info("tracing on: spans exported over OTLP/HTTP")
    return True


def instrument() -> None:
    """The standard instrumentations: Django requests (and an incoming ``traceparent``), psycopg
    statements, Redis commands, Celery tasks."""
    from opentelemetry.instrumentation.celery import CeleryInstrumentor
    from opentelemetry.instrumentation.django import DjangoInstrumentor
    from opentelemetry.instrumentation.psycopg import PsycopgInstrumentor
    from opentelemetry.instrumentation.redis import RedisInstrumentor

    DjangoInstrumentor().instrument()
    PsycopgInstrumentor().instrument()
    RedisInstrumentor().instrument()
    CeleryInstrumentor().instrument()
