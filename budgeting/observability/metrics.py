"""Prometheus histograms, counters and gauges observed in the process that served a request (admission and
ladder latencies, provider counts, counting breakers). The bottom of observability: it imports no room, so any
room may record into it. ``budgeting/observability/scrape.py`` serves them, with the series read from the
database at scrape time.

When ``PROMETHEUS_MULTIPROC_DIR`` is set (it must be, before the workers start, under a multi-process WSGI
server) the values go to files in that folder and every scrape merges all workers' files.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# Not registered anywhere at import: each scrape builds its own registry (``scrape.registry``), so the
# histograms are exposed once whether or not multiprocess mode is on.
ADMISSION_LATENCY = Histogram(
    "tokenbudget_admission_latency_seconds",
    "Time to answer POST /admissions, by the rung used.",
    ["rung"],
    buckets=LATENCY_BUCKETS,
    registry=None,
)
LADDER_LATENCY = Histogram(
    "tokenbudget_ladder_latency_seconds",
    "Time spent rendering, counting and walking the ladder for one request.",
    buckets=LATENCY_BUCKETS,
    registry=None,
)


PROVIDER_COUNTS = Counter(
    "tokenbudget_provider_counts",
    "Provider counting API counts asked by admissions, by counter and outcome (counted, cached, "
    "circuit_open, timeout, rate_limited, server, unreachable, refused, malformed).",
    ["counter", "outcome"],
    registry=None,
)
COUNTING_CIRCUIT_OPEN = Gauge(
    "tokenbudget_counting_circuit_open",
    "1 while a counting API's circuit breaker is open in some worker (its models' counting is unavailable).",
    ["counter", "endpoint"],
    registry=None,
    multiprocess_mode="max",
)


def count_provider_count(counter: str, outcome: str) -> None:
    """Count one provider count asked by an admission, by how it ended."""
    PROVIDER_COUNTS.labels(counter=counter, outcome=outcome).inc()


def set_counting_circuit(counter: str, endpoint: str, opened: bool) -> None:
    """Show whether the breaker of a counting API endpoint is open."""
    COUNTING_CIRCUIT_OPEN.labels(counter=counter, endpoint=endpoint).set(1 if opened else 0)


def observe_admission_latency(seconds: float, rung: str) -> None:
    """Record how long one admission took (call it once per answered request)."""
    ADMISSION_LATENCY.labels(rung=rung).observe(seconds)


def observe_ladder_latency(seconds: float) -> None:
    """Record how long the ladder (render, count, rungs) took for one request."""
    LADDER_LATENCY.observe(seconds)
