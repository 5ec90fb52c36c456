"""The alerts' admin: finance sets an account's alert thresholds (with a reason, into the change log); the
crossings that fired are listed read-only."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest

from budgeting.backoffice.kit import AuditedAdmin, AuditedForm, ReadOnlyAdmin
from budgeting.observability.alerts.models import AlertThresholds, ThresholdCrossing


class AlertThresholdsForm(AuditedForm):
    class Meta:
        model = AlertThresholds
        fields = ["account", "warning_percent", "critical_percent"]

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        warning, critical = data.get("warning_percent"), data.get("critical_percent")
        if warning is not None and warning < 1:
            self.add_error("warning_percent", "The warning threshold must be at least 1 %.")
        if warning is not None and critical is not None and critical <= warning:
            self.add_error("critical_percent", "The critical threshold must be above the warning threshold.")
        if critical is not None and critical > 1000:
            self.add_error("critical_percent", "The critical threshold can be at most 1000 %.")
        return data


@admin.register(AlertThresholds)
class AlertThresholdsAdmin(AuditedAdmin[AlertThresholds]):
    form = AlertThresholdsForm
    list_display = ["account", "warning_percent", "critical_percent", "updated_at"]
    search_fields = ["account__tenant__slug", "account__pool__slug", "account__task_class__slug"]
    fields = ["account", "warning_percent", "critical_percent"]

    def get_queryset(self, request: HttpRequest) -> QuerySet[AlertThresholds]:
        return (
            super()
            .get_queryset(request)
            .select_related("account__tenant", "account__task_class", "account__pool")
        )

    def get_readonly_fields(self, request: HttpRequest, obj: AlertThresholds | None = None) -> list[str]:
        # An account's thresholds row stays that account's: change the percentages, not the account.
        return ["account"] if obj is not None else []


@admin.register(ThresholdCrossing)
class ThresholdCrossingAdmin(ReadOnlyAdmin[ThresholdCrossing]):
    list_display = [
        "crossed_at",
        "account",
        "dimension",
        "severity",
        "percent",
        "used",
        "limit",
        "notified_at",
    ]
    list_filter = ["severity", "dimension"]
    date_hierarchy = "crossed_at"

    def get_queryset(self, request: HttpRequest) -> QuerySet[ThresholdCrossing]:
        return (
            super()
            .get_queryset(request)
            .select_related("account__tenant", "account__task_class", "account__pool")
        )
