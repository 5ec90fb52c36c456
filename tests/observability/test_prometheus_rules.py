"""The shipped alerting rules: `promtool check rules` accepts them, `promtool test rules` proves each alert
fires (and stays quiet) on synthetic series, and every series a rule reads is one /metrics serves."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from django.test import Client
from prometheus_client.parser import text_string_to_metric_families

from tests.ledger.helpers import catalog, tenant_account

RULES = Path(__file__).resolve().parents[2] / "prometheus"
PROMTOOL = shutil.which("promtool")
# Debian's `prometheus` package ships promtool: `apt-get install prometheus`.
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian: prometheus)")


def promtool(*args: str) -> str:
    assert PROMTOOL is not None
    done = subprocess.run([PROMTOOL, *args], cwd=RULES, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@needs_promtool
def test_promtool_accepts_the_rules():
    assert "SUCCESS: 7 rules found" in promtool("check", "rules", "alerts.yml")


@needs_promtool
def test_each_alert_fires_on_its_synthetic_series():
    assert "SUCCESS" in promtool("test", "rules", "alerts_test.yml")


@pytest.mark.django_db
def test_every_series_a_rule_reads_is_served(settings):
    settings.METRICS_TOKEN = "t"
    settings.METRICS_ALLOWED_NETWORKS = []
    tenant_account(catalog(), input_limit=100, output_limit=10)
    scraped = Client().get("/metrics", HTTP_AUTHORIZATION="Bearer t").content.decode()
    served = {s.name for family in text_string_to_metric_families(scraped) for s in family.samples}
    groups = yaml.safe_load((RULES / "alerts.yml").read_text())["groups"]
    expressions = [rule["expr"] for group in groups for rule in group["rules"]]
    read = {name for expr in expressions for name in re.findall(r"\btokenbudget_[a-z_]+", expr)}
    assert read and read <= served, read - served
