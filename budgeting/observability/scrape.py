"""``GET /metrics``, for scrapers the operator allowed (a bearer token or a network): a top-floor module (it
reads every room's rows), apart from the histograms of ``metrics.py`` that the rooms record into.

Most series are read from the database at scrape time by ``DatabaseCollector`` (admissions from the manifests,
deviation, overruns, leaks, backlog and quality from the reservations). Whichever gunicorn worker answers the
scrape reads the same rows, so these are multiprocess-safe by construction and survive restarts.

Latencies can only be observed in the process that served the request: ``metrics.py`` records them, and a
scrape merges all workers' files when ``PROMETHEUS_MULTIPROC_DIR`` is set.

The series name tenants and their traffic, so a scrape must carry ``Authorization: Bearer <METRICS_TOKEN>``
or come from one of ``METRICS_ALLOWED_NETWORKS``; anything else gets a plain-text 401 (or 403 when no token
is configured at all), never the series.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
from collections.abc import Iterator
from datetime import datetime

from django.conf import settings
from django.db import DatabaseError, connection
from django.db.models import Count, IntegerField, Q, Sum
from django.db.models.fields.json import KT
from django.db.models.functions import Cast, Coalesce
from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from django.views.decorators.http import require_GET
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest, multiprocess
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from budgeting.admission import drift
from budgeting.admission.models import Manifest
from budgeting.catalog.models import Counter as CounterKind
from budgeting.catalog.models import ModelRevision
from budgeting.catalog.snapshot import current as current_snapshot
from budgeting.observability.alerts.collector import AccountCollector
from budgeting.observability.metrics import (
    ADMISSION_LATENCY,
    COUNTING_CIRCUIT_OPEN,
    LADDER_LATENCY,
    PROVIDER_COUNTS,
)
from ledger.models import Reservation, State
from ledger.selectors import CONTEXT_OVERFLOW_PATTERN, leak_filter
from reconciliation.models import CostDrift

logger = logging.getLogger(__name__)

# Input deviation as a ratio: (provider-reported − our count) / our count. Our count is exact or a proven
# upper bound, so most mass should sit at 0 or just below it.
DEVIATION_BUCKETS = (-0.2, -0.1, -0.05, -0.02, -0.01, -0.005, 0.0, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2)


class DatabaseCollector(Collector):
    """Series computed from the database at scrape time. A database failure yields
    ``tokenbudget_metrics_database_up 0`` instead of failing the whole scrape."""

    def __init__(self, now: datetime | None = None) -> None:
        self.now = now

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("tokenbudget_metrics_database_up", "1 when the database series could be read.")
        try:
            families = list(self._families(self.now or timezone.now()))
        except DatabaseError:
            logger.exception("metrics: reading the database failed")
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from families

    def _families(self, now: datetime) -> Iterator[Metric]:
        yield self._admissions()
        yield self._count_methods()
        yield self._hard_bucket_changes()
        yield self._deviation()
        yield from self._overruns()
        yield self._context_overflows()
        yield self._leaks(now)
        yield from self._backlog(now)
        yield from self._quality()
        yield from self._cost_drift()
        yield from self._counter_drift()

    def _count_methods(self) -> Metric:
        family = CounterMetricFamily(
            "tokenbudget_admission_count_methods",
            "Admission decisions by the model revision counted for and the count method that answered "
            "(EXACT, UPPER_BOUND, PROVIDER_COUNT; empty when nothing was counted).",
            labels=["model_revision", "count_method"],
        )
        rows = Manifest.objects.values_list("model_revision__name", "count_method").annotate(n=Count("pk"))
        for name, method, n in rows.order_by():
            family.add_metric([name, method], n)
        return family

    def _counter_drift(self) -> Iterator[Metric]:
        """Each counter's drift from the providers' reports (``budgeting.admission.drift``), and whether each
        model revision's counter is out of the active policy's bound (0 without a bound or a verdict)."""
        policy = current_snapshot()[0].policy
        bound = None if policy is None else policy.counter_drift
        found = {(status.model_revision, status.count_method): status for status in drift.statuses(bound)}
        ratio = GaugeMetricFamily(
            "tokenbudget_counter_drift_ratio",
            "|provider-reported input − admitted count| / admitted count over the latest settled calls, by "
            "model revision, counter (count method) and quantile.",
            labels=["model_revision", "count_method", "quantile"],
        )
        calls = GaugeMetricFamily(
            "tokenbudget_counter_drift_calls",
            "Settled calls the drift quantiles are over.",
            labels=["model_revision", "count_method"],
        )
        for (name, method), status in found.items():
            ratio.add_metric([name, method, "0.5"], status.p50)
            ratio.add_metric([name, method, "0.99"], status.p99)
            calls.add_metric([name, method], status.calls)
        exceeded = GaugeMetricFamily(
            "tokenbudget_counter_drift_exceeded",
            "1 when the model revision's counter drifted out of the policy's counterDrift bound; "
            "fallback=1 when the policy then makes its counting unavailable.",
            labels=["model_revision", "count_method", "fallback"],
        )
        for name, counter in ModelRevision.objects.values_list("name", "counter"):
            method = "EXACT" if counter == CounterKind.LOCAL else "PROVIDER_COUNT"
            verdict = found.get((name, method))
            out = verdict is not None and verdict.exceeded
            fallback = verdict is not None and verdict.falls_back
            exceeded.add_metric([name, method, "1" if fallback else "0"], 1 if out else 0)
        yield ratio
        yield calls
        yield exceeded

    def _admissions(self) -> Metric:
        family = CounterMetricFamily(
            "tokenbudget_admissions",
            "Admission decisions recorded in manifests.",
            labels=["tenant", "task_class", "rung", "decision", "mode", "answer"],
        )
        rows = (
            Manifest.objects.values_list(
                "tenant__slug", "task_class__slug", "rung", "decision", "mode", "answer"
            )
            .annotate(n=Count("pk"))
            .order_by()
        )
        for tenant, task, rung, decision, mode, answer, n in rows:
            family.add_metric([tenant, task, rung, decision, mode, answer], n)
        return family

    def _hard_bucket_changes(self) -> Metric:
        total = Manifest.objects.aggregate(
            n=Coalesce(Sum(Cast(KT("record__hardBucketChanges"), IntegerField())), 0)
        )["n"]
        family = CounterMetricFamily(
            "tokenbudget_hard_bucket_changes",
            "Hard buckets changed by the ladder, summed over every manifest (must stay 0).",
        )
        family.add_metric([], total)
        return family

    def _deviation(self) -> Metric:
        family = HistogramMetricFamily(
            "tokenbudget_input_deviation_ratio",
            "(provider-reported input − our count) / our count, per reservation with a provider report.",
            labels=["model_revision"],
        )
        cumulative = ", ".join(f"count(*) FILTER (WHERE d.ratio <= {edge!r})" for edge in DEVIATION_BUCKETS)
        with connection.cursor() as cursor:
            cursor.execute(_DEVIATION_SQL.format(cumulative=cumulative))
            rows = cursor.fetchall()
        for name, count, cumulative_counts in rows:
            buckets = [(str(edge), n) for edge, n in zip(DEVIATION_BUCKETS, cumulative_counts, strict=True)]
            buckets.append(("+Inf", count))
            # Negative buckets: the exposition format has no _sum then; the +Inf bucket is the count.
            family.add_metric([name], buckets, None)
        return family

    def _overruns(self) -> Iterator[Metric]:
        tokens = CounterMetricFamily(
            "tokenbudget_output_overrun_tokens",
            "Output tokens used beyond the reservation (posted anyway).",
            labels=["tenant"],
        )
        requests = CounterMetricFamily(
            "tokenbudget_overrun_reservations",
            "Reservations whose output went beyond what they held.",
            labels=["tenant"],
        )
        rows = (
            Reservation.objects.filter(overrun__gt=0)
            .values_list("tenant__slug")
            .annotate(n=Count("pk"), tokens=Sum("overrun"))
            .order_by()
        )
        for tenant, n, total in rows:
            tokens.add_metric([tenant], total)
            requests.add_metric([tenant], n)
        yield tokens
        yield requests

    def _context_overflows(self) -> Metric:
        family = CounterMetricFamily(
            "tokenbudget_provider_context_overflows",
            "Provider context-window refusals reported by gateways (POST .../fail).",
            labels=["model_revision"],
        )
        rows = (
            Reservation.objects.filter(failure_reason__iregex=CONTEXT_OVERFLOW_PATTERN)
            .values_list("model_revision__name")
            .annotate(n=Count("pk"))
            .order_by()
        )
        for name, n in rows:
            family.add_metric([name], n)
        return family

    def _leaks(self, now: datetime) -> Metric:
        family = GaugeMetricFamily(
            "tokenbudget_reservation_leaks",
            "Reservations holding capacity they should not (the ledger audit's leak definition).",
        )
        family.add_metric([], Reservation.objects.filter(leak_filter(now)).count())
        return family

    def _backlog(self, now: datetime) -> Iterator[Metric]:
        count = GaugeMetricFamily("tokenbudget_reconciling_reservations", "Reservations in RECONCILING.")
        oldest = GaugeMetricFamily(
            "tokenbudget_reconciling_oldest_age_seconds",
            "Seconds since the dispatch of the oldest RECONCILING reservation (0 when there is none).",
        )
        rows = Reservation.objects.filter(state=State.RECONCILING).values_list("dispatched_at", "created_at")
        ages = [(now - (dispatched or created)).total_seconds() for dispatched, created in rows]
        count.add_metric([], len(ages))
        oldest.add_metric([], max(ages, default=0.0))
        yield count
        yield oldest

    def _cost_drift(self) -> Iterator[Metric]:
        """The latest comparison of billed and settled cost per model revision and per account (Prometheus
        values are floats: the exact figures are the CostDrift rows)."""
        labels = ["dimension", "key", "currency"]
        billed = GaugeMetricFamily(
            "tokenbudget_billed_cost", "Billed cost in the latest import that compared it.", labels=labels
        )
        settled = GaugeMetricFamily(
            "tokenbudget_settled_cost",
            "Our settled cost (at the prices frozen on the reservations) for the same requests.",
            labels=labels,
        )
        drift = GaugeMetricFamily(
            "tokenbudget_billed_cost_drift",
            "Billed minus settled cost (positive: billed more).",
            labels=labels,
        )
        latest = CostDrift.objects.order_by(
            "dimension", "key", "currency", "-billing_import_id", "-id"
        ).distinct("dimension", "key", "currency")
        for row in latest:
            names = [row.dimension.lower(), row.key, row.currency]
            billed.add_metric(names, float(row.billed))
            settled.add_metric(names, float(row.settled))
            drift.add_metric(names, float(row.drift))
        yield billed
        yield settled
        yield drift

    def _quality(self) -> Iterator[Metric]:
        outcomes = CounterMetricFamily(
            "tokenbudget_task_outcomes",
            "Outcomes reported by gateways (POST .../outcome), by rung and success.",
            labels=["rung", "success"],
        )
        success = GaugeMetricFamily(
            "tokenbudget_task_success_ratio",
            "Share of reported outcomes that succeeded, by rung.",
            labels=["rung"],
        )
        citation = GaugeMetricFamily(
            "tokenbudget_citation_completeness_ratio",
            "Mean share of a request's minimum-retention evidence ids that its answer cited, by rung.",
            labels=["rung"],
        )
        rows = (
            Reservation.objects.filter(task_success__isnull=False)
            .values_list("rung")
            .annotate(
                ok=Count("pk", filter=Q(task_success=True)), failed=Count("pk", filter=Q(task_success=False))
            )
            .order_by()
        )
        for rung, ok, failed in rows:
            outcomes.add_metric([rung, "true"], ok)
            outcomes.add_metric([rung, "false"], failed)
            success.add_metric([rung], ok / (ok + failed))
        with connection.cursor() as cursor:
            cursor.execute(_CITATION_SQL)
            for rung, completeness in cursor.fetchall():
                citation.add_metric([rung], float(completeness))
        yield outcomes
        yield success
        yield citation


# Cumulative counts per bucket edge (``le``) in one pass: one FILTER aggregate per edge.
_DEVIATION_SQL = """
    SELECT m.name, count(*), ARRAY[{cumulative}]
      FROM (SELECT r.model_revision_id,
                   (r.input_reported - r.input_reserved)::float8 / r.input_reserved AS ratio
              FROM ledger_reservation r
             WHERE r.input_reported IS NOT NULL AND r.input_reserved > 0) d
      JOIN budgeting_modelrevision m ON m.id = d.model_revision_id
     GROUP BY m.name
"""

_CITATION_SQL = """
    SELECT r.rung,
           avg((SELECT count(*) FROM jsonb_array_elements_text(r.minimum_evidence_ids) m(id)
                 WHERE r.cited_evidence_ids ? m.id)::numeric / jsonb_array_length(r.minimum_evidence_ids))
      FROM ledger_reservation r
     WHERE r.cited_evidence_ids IS NOT NULL AND jsonb_array_length(r.minimum_evidence_ids) > 0
     GROUP BY r.rung
"""


def registry(now: datetime | None = None) -> CollectorRegistry:
    """A registry for one scrape: the database series plus the latency histograms, merged across worker
    processes when PROMETHEUS_MULTIPROC_DIR is set."""
    scrape = CollectorRegistry(auto_describe=False)
    scrape.register(DatabaseCollector(now))
    scrape.register(AccountCollector())
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        multiprocess.MultiProcessCollector(scrape)
    else:
        scrape.register(ADMISSION_LATENCY)
        scrape.register(LADDER_LATENCY)
        scrape.register(PROVIDER_COUNTS)
        scrape.register(COUNTING_CIRCUIT_OPEN)
    return scrape


def refusal(request: HttpRequest) -> HttpResponse | None:
    """Why this scrape may not read the series (401 without the right token, 403 without any configured),
    or None when it may."""
    networks = settings.METRICS_ALLOWED_NETWORKS
    if networks:
        try:
            address = ipaddress.ip_address(request.META.get("REMOTE_ADDR", ""))
        except ValueError:
            address = None
        if address is not None and any(address in network for network in networks):
            return None
    token: str = settings.METRICS_TOKEN
    if not token:
        return HttpResponse(
            "metrics are served only to METRICS_ALLOWED_NETWORKS; set METRICS_TOKEN to scrape elsewhere\n",
            status=403,
            content_type="text/plain; charset=utf-8",
        )
    scheme, _, offered = request.META.get("HTTP_AUTHORIZATION", "").partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(offered.strip().encode(), token.encode()):
        return None
    response = HttpResponse(
        "a scrape needs the header Authorization: Bearer <METRICS_TOKEN>\n",
        status=401,
        content_type="text/plain; charset=utf-8",
    )
    response["WWW-Authenticate"] = 'Bearer realm="metrics"'
    return response


@require_GET
def metrics_view(request: HttpRequest) -> HttpResponse:
    """GET /metrics in the Prometheus text format, for an allowed scraper."""
    refused = refusal(request)
    if refused is not None:
        return refused
    return HttpResponse(generate_latest(registry()), content_type=CONTENT_TYPE_LATEST)
