"""The per-account Prometheus gauges: limit, reserved and consumed tokens, use as a share of the limit, and
the account's alert thresholds (the shipped rules in ``prometheus/alerts.yml`` compare the two)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

from django.db import DatabaseError
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from budgeting.observability.alerts.thresholds import AccountUse, account_uses

logger = logging.getLogger(__name__)

LABELS = ["account", "scope", "tenant", "task_class", "pool", "dimension"]


def _labels(use: AccountUse) -> list[str]:
    account = use.account
    return [
        str(account.pk),
        account.scope,
        account.tenant.slug if account.tenant else "",
        account.task_class.slug if account.task_class else "",
        account.pool.slug if account.pool else "",
        use.dimension,
    ]


class AccountCollector(Collector):
    """Read at scrape time from the accounts' rows. A database failure leaves these series out (the
    database collector's ``tokenbudget_metrics_database_up`` says why)."""

    def collect(self) -> Iterator[Metric]:
        limit = GaugeMetricFamily(
            "tokenbudget_account_limit_tokens",
            "The account's limit for its period (unlimited: absent).",
            labels=LABELS,
        )
        reserved = GaugeMetricFamily(
            "tokenbudget_account_reserved_tokens", "Tokens held by open reservations.", labels=LABELS
        )
        consumed = GaugeMetricFamily(
            "tokenbudget_account_consumed_tokens", "Tokens consumed in the current period.", labels=LABELS
        )
        ratio = GaugeMetricFamily(
            "tokenbudget_account_used_ratio",
            "(consumed + reserved) / limit: the share of the limit admission counts as used.",
            labels=LABELS,
        )
        threshold = GaugeMetricFamily(
            "tokenbudget_account_alert_threshold_ratio",
            "The account's alert thresholds as shares of its limit (finance sets them; default 0.8 and 1).",
            labels=["account", "severity"],
        )
        try:
            uses = list(account_uses())
        except DatabaseError:
            logger.exception("metrics: reading the capacity accounts failed")
            return
        for use in uses:
            labels = _labels(use)
            reserved.add_metric(labels, use.reserved)
            consumed.add_metric(labels, use.consumed)
            if use.limit is not None and use.ratio is not None:
                limit.add_metric(labels, use.limit)
                ratio.add_metric(labels, use.ratio)
        for account_id, thresholds in {u.account.pk: u.thresholds for u in uses}.items():
            for severity, percent in thresholds:
                threshold.add_metric([str(account_id), str(severity)], percent / 100)
        yield from (limit, reserved, consumed, ratio, threshold)
