"""Capacity alerts: finance's thresholds per account (80 % and 100 % by default), a crossing recorded once per
threshold and period, posted once to a real local HTTP receiver as Slack-compatible JSON (retried when the
receiver fails), and the per-account gauges in /metrics."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from django.db import IntegrityError, transaction
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from budgeting.catalog.models import ChangeRecord
from budgeting.observability.alerts.models import AlertThresholds, ThresholdCrossing
from budgeting.observability.alerts.service import check_thresholds
from budgeting.tasks import check_alert_thresholds
from ledger.models import CapacityAccount
from tests.admin.conftest import login
from tests.ledger.helpers import catalog, pool_account, tenant_account

pytestmark = pytest.mark.django_db


class Receiver:
    """A real HTTP server on loopback that records what it is sent (and can be told to fail)."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.fail_with: int | None = None
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers["Content-Length"])
                body = json.loads(self.rfile.read(length))
                status = receiver.fail_with or 200
                if status == 200:
                    receiver.bodies.append(body)
                self.send_response(status)
                self.send_header("Content-Type", "text/plain")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hooks/alerts"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Receiver:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with Receiver() as running:
        yield running


@pytest.fixture
def accounts() -> dict[str, CapacityAccount]:
    cat = catalog(tenant_slug="t-19", pool_slug="eu-large", task_slug="contract-review")
    return {
        "tenant": tenant_account(cat, input_limit=1_000_000, output_limit=100_000),
        "pool": pool_account(cat, input_limit=None, output_limit=None),
    }


def use(account: CapacityAccount, *, consumed: int = 0, reserved: int = 0, output: int = 0) -> None:
    CapacityAccount.objects.filter(pk=account.pk).update(
        input_consumed=consumed, input_reserved=reserved, output_consumed=output
    )


def run(receiver: Receiver | None = None, **kwargs: Any):
    return check_thresholds(now=timezone.now(), webhook_url=receiver.url if receiver else None, **kwargs)


def test_default_thresholds_fire_once_per_crossing_per_period(accounts, receiver):
    tenant = accounts["tenant"]
    use(tenant, consumed=700_000, reserved=90_000)  # 79 %: nothing yet
    assert (run(receiver).crossed, receiver.bodies) == (0, [])
    use(tenant, consumed=700_000, reserved=100_000)  # 80 %, counting what is reserved
    first = run(receiver)
    assert (first.crossed, first.posted) == (1, 1)
    body = receiver.bodies[0]
    assert body["text"].startswith(":warning: Token budget warning: tenant t-19 has used 80 % of its input")
    assert "(800,000 of 1,000,000 tokens; threshold 80 %)" in body["text"]
    assert body["attachments"][0]["color"] == "warning"
    assert {"title": "limit (tokens)", "value": "1,000,000", "short": True} in body["attachments"][0][
        "fields"
    ]
    assert (run(receiver).crossed, len(receiver.bodies)) == (0, 1)  # the same crossing never fires again
    use(tenant, consumed=500_000)  # back under, then over again within the period: still once
    run(receiver)
    use(tenant, consumed=1_000_000)
    assert run(receiver).posted == 1
    assert [b["attachments"][0]["color"] for b in receiver.bodies] == ["warning", "danger"]
    assert receiver.bodies[1]["text"].startswith(":rotating_light: Token budget critical")
    # A new period is a new crossing.
    CapacityAccount.objects.filter(pk=tenant.pk).update(period_start=tenant.period_start + timedelta(days=31))
    assert run(receiver).posted == 2
    assert ThresholdCrossing.objects.filter(account=tenant).count() == 4


def test_thresholds_are_per_account_and_set_by_finance(users, accounts, receiver):
    tenant = accounts["tenant"]
    finance = login("finance")
    add = reverse("admin:budgeting_alertthresholds_add")
    refused = finance.post(
        add, {"account": tenant.pk, "warning_percent": 90, "critical_percent": 90, "change_reason": "x"}
    )
    assert "The critical threshold must be above the warning threshold." in refused.content.decode()
    done = finance.post(
        add,
        {"account": tenant.pk, "warning_percent": 90, "critical_percent": 120, "change_reason": "big month"},
    )
    assert done.status_code == 302
    assert ChangeRecord.objects.filter(action="alertthresholds.add", reason="big month").exists()
    use(tenant, consumed=850_000)
    assert run(receiver).crossed == 0  # 85 % is under this account's 90 %
    use(tenant, consumed=1_000_000)
    assert run(receiver).crossed == 1  # 100 %: warning only; critical is at 120 %
    assert receiver.bodies[0]["text"].count("threshold 90 %") == 1
    assert login("analyst").post(add, {"account": tenant.pk}).status_code == 403
    assert login("platform").get(reverse("admin:budgeting_alertthresholds_changelist")).status_code == 200


def test_thresholds_keep_their_order_in_the_database(accounts):
    with pytest.raises(IntegrityError), transaction.atomic():
        AlertThresholds.objects.create(account=accounts["tenant"], warning_percent=90, critical_percent=80)


def test_a_failing_receiver_is_retried_and_a_missing_webhook_posts_nothing(accounts, receiver):
    use(accounts["tenant"], consumed=900_000)
    assert (run(None).crossed, run(None).posted) == (1, 0)  # recorded, nowhere to post
    receiver.fail_with = 503
    assert run(receiver).posted == 0
    assert ThresholdCrossing.objects.get().notified_at is None
    receiver.fail_with = None
    assert run(receiver).posted == 1
    assert ThresholdCrossing.objects.get().notified_at is not None
    assert len(receiver.bodies) == 1


def test_the_beat_task_reads_the_webhook_setting(accounts, receiver, settings):
    settings.ALERT_WEBHOOK_URL = receiver.url
    use(accounts["tenant"], output=100_000)
    assert check_alert_thresholds() == {"crossed": 2, "posted": 2}  # output at 100 %: warning and critical
    assert {b["attachments"][0]["color"] for b in receiver.bodies} == {"warning", "danger"}


@pytest.mark.django_db(transaction=True)
def test_two_beats_at_once_post_each_crossing_once(accounts, receiver):
    use(accounts["tenant"], consumed=1_000_000)
    results: list[Any] = []
    threads = [threading.Thread(target=lambda: results.append(run(receiver))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(r.posted for r in results) == 2
    assert len(receiver.bodies) == 2 and ThresholdCrossing.objects.count() == 2


def test_the_gauges_show_limit_reserved_consumed_and_thresholds(accounts, settings):
    settings.METRICS_TOKEN = "t"
    settings.METRICS_ALLOWED_NETWORKS = []
    tenant, pool = accounts["tenant"], accounts["pool"]
    use(tenant, consumed=600_000, reserved=50_000)
    AlertThresholds.objects.create(account=pool, warning_percent=50, critical_percent=75)
    response = Client().get("/metrics", HTTP_AUTHORIZATION="Bearer t")
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.content.decode())
        for s in family.samples
    }
    labels = (
        ("account", str(tenant.pk)),
        ("dimension", "input"),
        ("pool", ""),
        ("scope", "TENANT"),
        ("task_class", ""),
        ("tenant", "t-19"),
    )
    assert samples[("tokenbudget_account_limit_tokens", labels)] == 1_000_000
    assert samples[("tokenbudget_account_reserved_tokens", labels)] == 50_000
    assert samples[("tokenbudget_account_consumed_tokens", labels)] == 600_000
    assert samples[("tokenbudget_account_used_ratio", labels)] == 0.65
    threshold = "tokenbudget_account_alert_threshold_ratio"
    assert samples[(threshold, (("account", str(tenant.pk)), ("severity", "warning")))] == 0.8
    assert samples[(threshold, (("account", str(pool.pk)), ("severity", "critical")))] == 0.75
    # An unlimited account has no limit and no ratio, but its reserved and consumed tokens are there.
    pool_labels = dict(labels, account=str(pool.pk), scope="POOL", tenant="", pool="eu-large")
    pool_key = tuple(sorted(pool_labels.items()))
    assert ("tokenbudget_account_limit_tokens", pool_key) not in samples
    assert samples[("tokenbudget_account_consumed_tokens", pool_key)] == 0
