"""The reservations' admin: each reservation with its lifecycle (read-only), the RECONCILING backlog with the
reservations that need a person and finance's page that resolves one, and the ledger entries (read-only:
ledger rows are never edited or deleted)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

from django import forms
from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString

from budgeting.backoffice.formats import CountField, count, revision_name, signed
from budgeting.backoffice.kit import (
    ReadOnlyAdmin,
    Row,
    StepForm,
    actor,
    admin_page,
    figure_column,
    link,
    require,
    two_step_page,
)
from budgeting.backoffice.manifest_admin import manifest_context
from budgeting.backoffice.reports.charts import backlog_chart
from budgeting.backoffice.reports.selectors import reconciling_backlog
from ledger.models import LedgerEntry, Reservation, State
from ledger.services.settlement import Resolution, needing_a_person, resolve_for_person

# Resolving a reservation posts compensating ledger entries: finance's correction permission.
RESOLVE_PERMISSION = "ledger.add_ledgerentry"
BACKLOG_ROWS = 500
RESOLUTION_CHOICES = [
    (Resolution.AS_RECORDED, "Processed as we recorded it: post what was captured, release the rest"),
    (Resolution.AS_BILLED, "Processed and billed at the amounts below (from the provider's records)"),
    (Resolution.NOT_PROCESSED, "Never processed: give back what was consumed and release everything"),
]


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
    return ", ".join(f"{name} {signed(value)}" for name, value in parts if value)


_PHASE = ("start", "dispatch", "usage", "ledger", "end")


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
        detail = f"{count(event.output_tokens)} output tokens"
        if event.input_tokens is not None:
            detail += f", {count(event.input_tokens)} input tokens reported"
        if event.overrun:
            detail += f" (overrun {count(event.overrun)})"
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
    # Strictly by time, so the times read down the page never go back; at the same instant, in lifecycle
    # order. (The terminal state's time is the caller's clock, which can precede the entries it wrote: it
    # then comes before them, at its own time, rather than last under a later one.)
    items.sort(key=lambda item: (item.at, _PHASE.index(item.kind)))
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


class ResolveForm(StepForm):
    """What a person decided about a reservation no evidence can settle."""

    resolution = forms.ChoiceField(
        choices=RESOLUTION_CHOICES, widget=forms.RadioSelect, label="What happened to this call"
    )
    input_tokens = CountField(required=False, min_value=0, label="Billed input tokens")
    output_tokens = CountField(required=False, min_value=0, label="Billed output tokens")
    field_order = ["resolution", "input_tokens", "output_tokens", "reason"]

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        billed = data.get("resolution") == Resolution.AS_BILLED
        for name in ("input_tokens", "output_tokens"):
            if billed and data.get(name) is None:
                self.add_error(name, "Give the amount the provider billed (0 if none).")
            elif not billed and data.get(name) is not None:
                self.add_error(name, "Leave empty unless the call was billed at amounts you give.")
        return data


def resolution_rows(reservation: Reservation, data: dict[str, Any]) -> tuple[list[Row], list[str]]:
    """The preview of a resolution: the reservation's consumption now and after, and what to know first."""
    output_now = reservation.captured + reservation.overrun
    after = {
        Resolution.AS_RECORDED: (reservation.input_consumed, output_now),
        Resolution.AS_BILLED: (data.get("input_tokens") or 0, data.get("output_tokens") or 0),
        Resolution.NOT_PROCESSED: (0, 0),
    }[Resolution(data["resolution"])]
    rows: list[Row] = [
        ("what happened", "unknown", dict(RESOLUTION_CHOICES)[Resolution(data["resolution"])], False),
        ("state", reservation.state, f"{State.SETTLED} (reconciled by a person)", False),
        (
            "input tokens consumed",
            count(reservation.input_consumed),
            count(after[0]),
            after[0] != reservation.input_consumed,
        ),
        ("output tokens consumed", count(output_now), count(after[1]), after[1] != output_now),
        ("output tokens still held", count(reservation.remaining), "0 (released)", False),
    ]
    warnings = []
    if data["resolution"] == Resolution.NOT_PROCESSED and (output_now or reservation.input_consumed):
        warnings.append(
            f"Usage was recorded for this call ({count(reservation.input_consumed)} input and "
            f"{count(output_now)} output tokens): saying it was never processed gives those tokens back to "
            "every account it held."
        )
    return rows, warnings


@admin.register(Reservation)
class ReservationAdmin(ReadOnlyAdmin[Reservation]):
    list_display = [
        "request",
        "scope",
        "state_badge",
        "rung_mode",
        "input_col",
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

    @admin.display(description="request", ordering="created_at")
    def request(self, obj: Reservation) -> SafeString:
        return format_html(
            '{}<span class="tb-sub">{} UTC</span>', obj.request_id, f"{obj.created_at:%Y-%m-%d %H:%M:%S}"
        )

    @admin.display(description="tenant · task class · pool")
    def scope(self, obj: Reservation) -> SafeString:
        return format_html(
            '{} · {} · {}<span class="tb-sub">{}</span>',
            obj.tenant,
            obj.task_class,
            obj.model_pool,
            revision_name(str(obj.model_revision)),
        )

    @admin.display(description="state", ordering="state")
    def state_badge(self, obj: Reservation) -> SafeString:
        badge = format_html('<span class="tb-state tb-state-{}">{}</span>', obj.state.lower(), obj.state)
        if obj.state == State.RECONCILING and obj.needs_person:
            badge = format_html('{} <span class="tb-person">needs a person</span>', badge)
        return format_html('{}<span class="tb-sub">{}</span>', badge, obj.outcome or "")

    @admin.display(description="rung · mode", ordering="rung")
    def rung_mode(self, obj: Reservation) -> SafeString:
        return format_html('{}<span class="tb-sub">{}</span>', obj.rung, obj.mode.lower())

    input_col = figure_column("input_reserved", "input tokens reserved")

    @admin.display(description="output tokens captured / held")
    def output_col(self, obj: Reservation) -> SafeString:
        return format_html(
            '<div class="tb-num">{} / {}</div>',
            count(obj.captured + obj.overrun),
            count(obj.output_reserved + obj.top_ups),
        )

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
            "can_resolve": request.user.has_perm(RESOLVE_PERMISSION),
            **(manifest_context(obj.manifest) if obj.manifest else {}),
        }

    def page_urls(self) -> list[tuple[str, Callable[..., HttpResponse], str]]:
        return [
            ("reconciling/", self.backlog_view, "ledger_reservation_backlog"),
            ("<uuid:reservation_id>/resolve/", self.resolve_view, "ledger_reservation_resolve"),
        ]

    def backlog_view(self, request: HttpRequest) -> HttpResponse:
        """RECONCILING reservations, oldest first, with their age since dispatch; those that need a person
        first, apart."""
        require(request, "ledger.view_reservation")
        now = timezone.now()
        rows = [
            (r, age_text((now - (r.dispatched_at or r.created_at)).total_seconds()))
            for r in Reservation.objects.filter(state=State.RECONCILING, needs_person="")
            .select_related("tenant", "model_pool", "model_revision")
            .order_by("dispatched_at", "created_at")[:BACKLOG_ROWS]
        ]
        people = [
            (r, age_text((now - (r.needs_person_since or now)).total_seconds()))
            for r in needing_a_person().select_related("model_revision")[:BACKLOG_ROWS]
        ]
        backlog = reconciling_backlog(now)
        slots_freed = Reservation.objects.filter(state=State.RECONCILING, concurrency_held=False).count()
        return admin_page(
            request,
            self,
            "admin/ledger/reservation/backlog.html",
            {
                "title": "Reconciling backlog",
                "rows": rows,
                "people": people,
                "limit": BACKLOG_ROWS,
                "can_resolve": request.user.has_perm(RESOLVE_PERMISSION),
                "backlog": backlog,
                "slots_freed": slots_freed,
                "oldest": age_text(backlog["oldestAgeSeconds"])
                if backlog["oldestAgeSeconds"] is not None
                else "—",
                "chart": backlog_chart(backlog),
                "billing_url": reverse("admin:reconciliation_billingimport_changelist"),
            },
        )

    def resolve_view(self, request: HttpRequest, reservation_id: UUID) -> HttpResponse:
        """Finance resolves a reservation no evidence can settle: form, confirmation, one service call."""
        require(request, RESOLVE_PERMISSION)
        reservation = self.object_or_404(request, reservation_id)

        def apply(data: dict[str, Any]) -> str:
            resolution = Resolution(data["resolution"])
            resolve_for_person(
                reservation_id=reservation.pk,
                resolution=resolution,
                actor=actor(request),
                reason=data["reason"],
                now=timezone.now(),
                input_tokens=data["input_tokens"],
                output_tokens=data["output_tokens"],
            )
            return f"{reservation.request_id} resolved ({resolution.lower().replace('_', ' ')}) and settled."

        return two_step_page(
            request,
            self,
            reservation,
            ResolveForm,
            title=f"Resolve {reservation.request_id}",
            lead="No evidence can settle this call: "
            f"{reservation.needs_person or reservation.failure_reason}. "
            "Say what happened, from the provider's records; the ledger posts compensating entries on every "
            "account the call held and the change log keeps your reason.",
            submit="Resolve",
            preview=lambda data: resolution_rows(reservation, data),
            apply=apply,
            initial={"step": "edit"},
            edit_context={"reservation": reservation},
        )


@admin.register(LedgerEntry)
class LedgerEntryAdmin(ReadOnlyAdmin[LedgerEntry]):
    list_display = [
        "id",
        "at",
        "account",
        "kind",
        "reservation_link",
        "input_reserved_col",
        "input_consumed_col",
        "output_reserved_col",
        "output_consumed_col",
        "in_flight_col",
        "reason_col",
    ]
    list_filter = ["kind", "account__scope", "created_at"]
    search_fields = ["reason", "created_by", "=reservation__id"]
    change_list_template = "admin/tokenbudget/wide_change_list.html"
    date_hierarchy = "created_at"
    list_select_related = ["account__tenant", "account__task_class", "account__pool"]

    input_reserved_col = figure_column("input_reserved", "input tokens reserved", signed)
    input_consumed_col = figure_column("input_consumed", "input tokens consumed", signed)
    output_reserved_col = figure_column("output_reserved", "output tokens reserved", signed)
    output_consumed_col = figure_column("output_consumed", "output tokens consumed", signed)
    in_flight_col = figure_column("in_flight", "requests in flight", signed)

    @admin.display(description="at (UTC)", ordering="created_at")
    def at(self, obj: LedgerEntry) -> str:
        return f"{obj.created_at:%Y-%m-%d %H:%M:%S}"

    @admin.display(description="reservation")
    def reservation_link(self, obj: LedgerEntry) -> SafeString | str:
        return link_to_reservation(obj.reservation_id)

    @admin.display(description="reason (by)", ordering="reason")
    def reason_col(self, obj: LedgerEntry) -> SafeString:
        by = format_html(' <span class="tb-muted">({})</span>', obj.created_by) if obj.created_by else ""
        return format_html("{}{}", obj.reason or "—", by)
