"""GET /metrics: only an allowed scraper (bearer token or network) reads it; the series read from the
database agree with it, latencies are exposed, and in multiprocess mode observations from several processes
are merged."""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.db import OperationalError
from django.test import Client
from django.utils import timezone
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from budgeting.admission.models import Manifest
from budgeting.observability import metrics
from budgeting.observability import scrape as scraping
from ledger import selectors
from ledger.models import Reservation
from tests.admin.scenario import record

pytestmark = pytest.mark.django_db
REPO = Path(__file__).resolve().parents[2]
TOKEN = "scrape-token-for-tests"


@pytest.fixture(autouse=True)
def metrics_token(settings):
    settings.METRICS_TOKEN = TOKEN
    settings.METRICS_ALLOWED_NETWORKS = []


def scrape() -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    response = Client().get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain")
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def value(samples, name: str, **labels: str) -> float:
    return samples[name][tuple(sorted(labels.items()))]


@pytest.mark.parametrize("authorization", [None, "Bearer wrong-token", f"Basic {TOKEN}", "Bearer"])
def test_a_scrape_without_the_token_is_refused_without_a_series(scenario, authorization):
    headers = {} if authorization is None else {"HTTP_AUTHORIZATION": authorization}
    response = Client().get("/metrics", **headers)
    assert response.status_code == 401
    assert response["WWW-Authenticate"] == 'Bearer realm="metrics"'
    assert response["Content-Type"].startswith("text/plain")
    assert b"tokenbudget_" not in response.content and b"t-19" not in response.content


def test_with_no_token_configured_metrics_are_refused_to_everyone(settings, scenario):
    settings.METRICS_TOKEN = ""
    for headers in ({}, {"HTTP_AUTHORIZATION": "Bearer "}, {"HTTP_AUTHORIZATION": f"Bearer {TOKEN}"}):
        response = Client().get("/metrics", **headers)
        assert response.status_code == 403
        assert b"t-19" not in response.content


def test_an_allowed_network_scrapes_without_a_token(settings, scenario):
    settings.METRICS_TOKEN = ""
    settings.METRICS_ALLOWED_NETWORKS = [ipaddress.ip_network("10.8.0.0/16"), ipaddress.ip_network("::1/128")]
    inside = Client(REMOTE_ADDR="10.8.3.4").get("/metrics")
    assert inside.status_code == 200 and b'tenant="t-19"' in inside.content
    assert Client(REMOTE_ADDR="::1").get("/metrics").status_code == 200
    assert Client(REMOTE_ADDR="10.9.0.1").get("/metrics").status_code == 403
    # With a token configured as well, outsiders may still scrape with it.
    settings.METRICS_TOKEN = TOKEN
    outsider = Client(REMOTE_ADDR="10.9.0.1")
    assert outsider.get("/metrics").status_code == 401
    assert outsider.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}").status_code == 200


def test_admissions_by_tenant_task_rung_decision_and_mode(scenario):
    samples = scrape()
    key = {"tenant": "t-19", "task_class": "contract-review"}
    assert (
        value(
            samples,
            "tokenbudget_admissions_total",
            **key,
            rung="FULL",
            decision="ADMITTED",
            mode="ENFORCE",
            answer="",  # the scenario writes manifests directly, without an answer
        )
        == 3
    )
    assert (
        value(
            samples,
            "tokenbudget_admissions_total",
            **key,
            rung="FULL",
            decision="ADMITTED",
            mode="SHADOW",
            answer="",
        )
        == 1
    )
    assert sum(samples["tokenbudget_admissions_total"].values()) == Manifest.objects.count()


def test_deviation_overruns_overflows_backlog_and_quality(scenario):
    samples = scrape()
    model = {"model_revision": scenario.model.name}
    assert value(samples, "tokenbudget_input_deviation_ratio_bucket", **model, le="-0.01") == 1
    assert value(samples, "tokenbudget_input_deviation_ratio_bucket", **model, le="0.0") == 2
    assert value(samples, "tokenbudget_input_deviation_ratio_bucket", **model, le="+Inf") == 3
    assert value(samples, "tokenbudget_output_overrun_tokens_total", tenant="t-19") == 30
    assert value(samples, "tokenbudget_overrun_reservations_total", tenant="t-19") == 1
    assert value(samples, "tokenbudget_provider_context_overflows_total", **model) == 1
    assert value(samples, "tokenbudget_reconciling_reservations") == 1
    assert value(samples, "tokenbudget_reconciling_oldest_age_seconds") >= 39 * 60
    assert value(samples, "tokenbudget_task_success_ratio", rung="FULL") == 1.0
    assert value(samples, "tokenbudget_task_outcomes_total", rung="DEDUP_EVIDENCE", success="false") == 1
    assert value(samples, "tokenbudget_citation_completeness_ratio", rung="DEDUP_EVIDENCE") == 0.5
    assert value(samples, "tokenbudget_metrics_database_up") == 1


def test_leaks_match_the_ledger_audit(scenario):
    Reservation.objects.filter(pk=scenario.reservations["full"].pk).update(concurrency_held=True)
    now = timezone.now()
    expected = len(selectors.audit(now=now).leaks)
    assert expected >= 1
    samples = {}
    text = generate_latest(scraping.registry(now=now)).decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name] = sample.value
    assert samples["tokenbudget_reservation_leaks"] == expected


def test_hard_bucket_changes_are_summed_over_manifests(scenario):
    assert value(scrape(), "tokenbudget_hard_bucket_changes_total") == 0
    manifest = scenario.manifests["full"]
    Manifest.objects.filter(pk=manifest.pk).update(record=record("FULL", tokens=10, hard_changes=2))
    assert value(scrape(), "tokenbudget_hard_bucket_changes_total") == 2


def test_latency_histograms_are_exposed(db):
    metrics.observe_admission_latency(0.03, "DEDUP_EVIDENCE")
    metrics.observe_ladder_latency(0.002)
    samples = scrape()
    assert value(samples, "tokenbudget_admission_latency_seconds_count", rung="DEDUP_EVIDENCE") >= 1
    assert (
        value(samples, "tokenbudget_admission_latency_seconds_bucket", rung="DEDUP_EVIDENCE", le="0.05") >= 1
    )
    assert value(samples, "tokenbudget_ladder_latency_seconds_count") >= 1


def test_the_metrics_endpoint_survives_a_database_failure(monkeypatch, db):
    def broken(self, now):
        raise OperationalError("connection refused")

    monkeypatch.setattr(scraping.DatabaseCollector, "_families", broken)
    assert value(scrape(), "tokenbudget_metrics_database_up") == 0


_OBSERVE = """
import django, os, sys
django.setup()
from budgeting.observability import metrics
metrics.observe_admission_latency(float(sys.argv[1]), "FULL")
"""

_READ = """
import django
django.setup()
from prometheus_client import generate_latest
from budgeting.observability import scrape
print(generate_latest(scrape.registry()).decode())
"""


def test_multiprocess_mode_merges_the_workers_observations(tmp_path):
    env = {
        **os.environ,
        "PROMETHEUS_MULTIPROC_DIR": str(tmp_path),
        "DJANGO_SETTINGS_MODULE": "budgeting.settings",
        # No database is needed to observe; the scrape's database series then report up=0.
        "DATABASE_URL": "postgres://nobody@127.0.0.1:1/none",
    }
    for seconds in ("0.02", "0.2"):
        subprocess.run([sys.executable, "-c", _OBSERVE, seconds], env=env, cwd=REPO, check=True, timeout=60)
    out = subprocess.run(
        [sys.executable, "-c", _READ],
        env=env,
        cwd=REPO,
        check=True,
        timeout=60,
        capture_output=True,
        text=True,
    ).stdout
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(out)
        for s in family.samples
    }
    assert samples[("tokenbudget_admission_latency_seconds_count", (("rung", "FULL"),))] == 2
    assert samples[("tokenbudget_admission_latency_seconds_bucket", (("le", "0.025"), ("rung", "FULL")))] == 1
    assert samples[("tokenbudget_metrics_database_up", ())] == 0
