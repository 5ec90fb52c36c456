"""The alert models: finance's thresholds per capacity account, and each threshold crossing (one per account,
period, dimension and severity, which is what makes the webhook fire once per crossing per period)."""

from __future__ import annotations

from django.db import models
from django.db.models import F, Q

DEFAULT_WARNING_PERCENT = 80
DEFAULT_CRITICAL_PERCENT = 100


class Severity(models.TextChoices):
    WARNING = "warning", "Warning"
    CRITICAL = "critical", "Critical"


class Dimension(models.TextChoices):
    INPUT = "input", "Input tokens"
    OUTPUT = "output", "Output tokens"


class AlertThresholds(models.Model):
    """When an account's use of a period's limit raises an alert, in percent of the limit. "Use" is what
    admission counts against the limit: tokens consumed plus tokens reserved. An account without a row uses
    the defaults (80 % warning, 100 % critical)."""

    account = models.OneToOneField(
        "ledger.CapacityAccount", on_delete=models.CASCADE, related_name="alert_thresholds"
    )
    warning_percent = models.PositiveSmallIntegerField(
        default=DEFAULT_WARNING_PERCENT, help_text="Warn when use reaches this share of the limit."
    )
    critical_percent = models.PositiveSmallIntegerField(
        default=DEFAULT_CRITICAL_PERCENT, help_text="Critical alert when use reaches this share of the limit."
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name = "alert thresholds"
        verbose_name_plural = "alert thresholds"
        constraints = [
            models.CheckConstraint(
                condition=Q(warning_percent__gte=1)
                & Q(critical_percent__gt=F("warning_percent"))
                & Q(critical_percent__lte=1000),
                name="alert_thresholds_ordered",
            )
        ]

    def __str__(self) -> str:
        return f"{self.warning_percent} % / {self.critical_percent} %"


class ThresholdCrossing(models.Model):
    """An account's use crossed a threshold in a period. Written once (the unique constraint), notified
    once: ``notified_at`` is set when the webhook took it."""

    account = models.ForeignKey("ledger.CapacityAccount", on_delete=models.CASCADE, related_name="+")
    period_start = models.DateTimeField()
    dimension = models.CharField(max_length=6, choices=Dimension.choices)
    severity = models.CharField(max_length=8, choices=Severity.choices)
    percent = models.PositiveSmallIntegerField(help_text="The threshold crossed, in percent of the limit.")
    used = models.BigIntegerField(help_text="Tokens consumed plus reserved when the crossing was seen.")
    limit = models.BigIntegerField()
    crossed_at = models.DateTimeField()
    notified_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-crossed_at", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["account", "period_start", "dimension", "severity"], name="threshold_crossed_once"
            )
        ]

    def __str__(self) -> str:
        return f"{self.severity} {self.dimension} {self.percent} % ({self.period_start:%Y-%m-%d})"
