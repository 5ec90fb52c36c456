"""The reservations' admin: each reservation with its lifecycle (read-only), the RECONCILING backlog, and the
ledger entries (read-only: ledger rows are never edited or deleted)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString

from budgeting.backoffice.kit import ReadOnlyAdmin, admin_page, link, require
from budgeting.backoffice.manifest_admin import manifest_context
from budgeting.backoffice.reports.charts import backlog_chart
from budgeting.backoffice.reports.selectors import reconciling_backlog
from ledger.models import LedgerEntry, Reservation, State


def link_to_reservation(reservation_id: UUID | None) -> SafeString | str:
    """A link to a reservation's page, named by the start of its id; "—" for none."""
    if reservation_id is None:
        return "—"
    return link(reverse("admin:ledger_reservation_change", args=[reservation_id]), str(reservation_id)[:8])


@dataclass(frozen=True)
class TimelineItem:
    at: datetime
    label: str
    detail: str
    kind: str


def _deltas(entry: LedgerEntry) -> str:
    parts = [
        (name, getattr(entry, field))
        for name, field in (
            ("input reserved", "input_reserved"),
            ("input consumed", "input_consumed"),
            ("output reserved", "output_reserved"),
            ("output consumed", "output_consumed"),
            ("in flight", "in_flight"),
        )
    ]
    return ", ".join(f"{name} {value:+,}" for name, value in parts if value)


def timeline(reservation: Reservation) -> list[TimelineItem]:
    """The reservation's lifecycle in time order: admission, each ledger movement (one line per operation,
    however many accounts it touched), usage events, dispatch and settlement."""
    first = "Queued (PROPOSED)" if reservation.queue_deadline else "Admitted (RESERVED)"
    items = [TimelineItem(reservation.created_at, first, f"rung {reservation.rung}", "start")]
    if reservation.dispatched_at:
        items.append(
            TimelineItem(
                reservation.dispatched_at, "Dispatched", reservation.provider_request_id or "", "dispatch"
            )
        )
    for event in reservation.usage_events.order_by("id"):
        detail = f"{event.output_tokens:,} output"
        if event.input_tokens is not None:
            detail += f", {event.input_tokens:,} input reported"
        if event.overrun:
            detail += f" (overrun {event.overrun:,})"
        label = f"Usage {event.usage_event_id}" + (" (final)" if event.final else "")
        items.append(TimelineItem(event.created_at, label, detail, "usage"))
    seen: set[tuple[Any, ...]] = set()
    for entry in reservation.entries.order_by("id"):
        key = (entry.kind, entry.reason, _deltas(entry))
        if key in seen:
            continue
        seen.add(key)
        accounts = reservation.entries.filter(
            kind=entry.kind,
            reason=entry.reason,
            input_reserved=entry.input_reserved,
            output_reserved=entry.output_reserved,
            input_consumed=entry.input_consumed,
            output_consumed=entry.output_consumed,
            in_flight=entry.in_flight,
        ).count()
        detail = _deltas(entry) + (f" on {accounts} accounts" if accounts > 1 else "")
        label = f"{entry.get_kind_display()}: {entry.reason}" if entry.reason else entry.get_kind_display()
        items.append(TimelineItem(entry.created_at, label, detail, "ledger"))
    items.sort(key=lambda item: item.at)
    # The terminal state goes last: settled_at is the caller's clock, taken before the entries it wrote.
    if reservation.settled_at:
        items.append(
            TimelineItem(
                reservation.settled_at, f"Settled ({reservation.outcome})", reservation.failure_reason, "end"
            )
        )
    elif reservation.state in {State.REJECTED, State.RECONCILING, State.PARTIALLY_SETTLED}:
        items.append(
            TimelineItem(reservation.updated_at, reservation.state, reservation.failure_reason, "end")
        )
    return items


def age_text(seconds: float) -> str:
    """A duration the way an operator reads it: 45 s, 12 min, 3 h 20 min, 2 d 4 h."""
    s = int(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min"
    if s < 86400:
        return f"{s // 3600} h {s % 3600 // 60} min"
    return f"{s // 86400} d {s % 86400 // 3600} h"


@admin.register(Reservation)
class ReservationAdmin(ReadOnlyAdmin[Reservation]):
    list_display = [
        "created_at",
        "request_id",
        "tenant",
        "task_class",
        "model_pool",
        "model_revision",
        "state_badge",
        "outcome",
        "rung",
        "mode",
        "input_reserved",
        "output_col",
        "fence",
    ]
    list_filter = ["state", "outcome", "rung", "mode", "tenant", "task_class", "model_pool", "created_at"]
    search_fields = ["request_id", "provider_request_id", "idempotency_key"]
    date_hierarchy = "created_at"
    change_form_template = "admin/ledger/reservation/change_form.html"
    change_list_template = "admin/ledger/reservation/change_list.html"
    fields = [
        "id",
        "request_id",
        "tenant",
        "task_class",
        "model_pool",
        "model_revision",
        "state",
        "outcome",
        "rung",
        "mode",
        "policy_revision",
        "manifest",
        "provider_request_id",
        "admitted_digest",
        "failure_reason",
        "created_at",
    ]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Reservation]:
        return (
            super()
            .get_queryset(request)
            .select_related("tenant", "task_class", "model_pool", "model_revision")
        )

    @admin.display(description="state", ordering="state")
    def state_badge(self, obj: Reservation) -> SafeString:
        return format_html('<span class="tb-state tb-state-{}">{}</span>', obj.state.lower(), obj.state)

    @admin.display(description="output captured / held")
    def output_col(self, obj: Reservation) -> str:
        return f"{obj.captured + obj.overrun:,} / {obj.output_reserved + obj.top_ups:,}"

    def page_context(self, request: HttpRequest, obj: Reservation) -> dict[str, Any]:
        return {
            "reservation": obj,
            "timeline": timeline(obj),
            "holds": obj.holds.select_related("account__tenant", "account__task_class", "account__pool"),
            "entries": obj.entries.select_related("account").order_by("id"),
            "usage_events": obj.usage_events.order_by("id"),
            "top_ups": obj.top_up_records.order_by("created_at"),
            "lease_over": obj.state in {State.SETTLED, State.REJECTED},
            "lease_expired": bool(obj.lease_expires_at and obj.lease_expires_at < timezone.now()),
            "can_view_manifest": request.user.has_perm("budgeting.view_manifest"),
            **(manifest_context(obj.manifest) if obj.manifest else {}),
        }

    def page_urls(self) -> list[tuple[str, Callable[..., HttpResponse], str]]:
        return [("reconciling/", self.backlog_view, "ledger_reservation_backlog")]

    def backlog_view(self, request: HttpRequest) -> HttpResponse:
        """RECONCILING reservations, oldest first, with their age since dispatch."""
        require(request, "ledger.view_reservation")
        now = timezone.now()
        rows = [
            (r, age_text((now - (r.dispatched_at or r.created_at)).total_seconds()))
            for r in Reservation.objects.filter(state=State.RECONCILING)
            .select_related("tenant", "model_pool", "model_revision")
            .order_by("dispatched_at", "created_at")[:500]
        ]
        backlog = reconciling_backlog(now)
        return admin_page(
            request,
            self,
            "admin/ledger/reservation/backlog.html",
            {
                "title": "Reconciling backlog",
                "rows": rows,
                "backlog": backlog,
                "oldest": age_text(backlog["oldestAgeSeconds"])
                if backlog["oldestAgeSeconds"] is not None
                else "—",
                "chart": backlog_chart(backlog),
                "billing_url": reverse("admin:reconciliation_billingimport_changelist"),
            },
        )


@admin.register(LedgerEntry)
class LedgerEntryAdmin(ReadOnlyAdmin[LedgerEntry]):
    list_display = [
        "id",
        "created_at",
        "account",
        "kind",
        "reservation_link",
        "input_reserved",
        "input_consumed",
        "output_reserved",
        "output_consumed",
        "in_flight",
        "reason",
        "created_by",
    ]
    list_filter = ["kind", "account__scope", "created_at"]
    search_fields = ["reason", "created_by", "=reservation__id"]
    change_list_template = "admin/tokenbudget/wide_change_list.html"
    date_hierarchy = "created_at"
    list_select_related = ["account__tenant", "account__task_class", "account__pool"]

    @admin.display(description="reservation")
    def reservation_link(self, obj: LedgerEntry) -> SafeString | str:
        return link_to_reservation(obj.reservation_id)
