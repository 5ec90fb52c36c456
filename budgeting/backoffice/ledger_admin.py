"""The ledger's admin: capacity accounts (limits, temporary increases, corrections), reservations (read-only,
with their lifecycle), ledger entries (read-only) and the RECONCILING backlog.

Balances and reservations change only through services. An account's page offers "Edit limits", "Grant a
temporary increase" and "Post a correction"; each is a form, then a confirmation page showing the effect,
then one call to ``budgeting.admin_services``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString

from budgeting import admin_services
from budgeting.admin_services import DimensionPreview
from budgeting.api.problems import Problem
from budgeting.backoffice import reports
from budgeting.backoffice.kit import (
    ReadOnlyAdmin,
    ReasonForm,
    actor,
    change_url,
    confirm_page,
    manifest_context,
    recent_changes,
    require,
)
from budgeting.backoffice.report_views import backlog_chart
from budgeting.catalog.models import TemporaryIncrease
from ledger.models import CapacityAccount, LedgerEntry, Reservation, State
from ledger.periods import period_start_for

WARN_AT = 0.8


def _n(value: int | None) -> str:
    return "∞" if value is None else f"{value:,}"


def _compact(value: int | None) -> SafeString:
    """Millions as "99.99 M" for the list's narrow columns; the exact figure is in the tooltip."""
    if value is None or abs(value) < 1_000_000:
        return format_html("{}", _n(value))
    return format_html('<span title="{}">{} M</span>', f"{value:,}", f"{value / 1_000_000:,.2f}")


def _share(used: int, limit: int | None) -> float | None:
    if limit is None:
        return None
    return 1.0 if limit == 0 else used / limit


def usage_bar(label: str, used: int, limit: int | None) -> SafeString:
    """A thin horizontal bar of used/limit, amber from 80 %, red at or over the limit."""
    share = _share(used, limit)
    if share is None:
        return format_html('<div class="tb-bar tb-bar-none" title="unlimited">{} ∞</div>', label)
    level = "over" if share >= 1 else "warn" if share >= WARN_AT else "ok"
    return format_html(
        '<div class="tb-bar tb-bar-{}" title="{}: {} of {}">'
        '<span style="width:{}%"></span><em>{} {}%</em></div>',
        level,
        label,
        _n(used),
        _n(limit),
        f"{min(share, 1.0) * 100:.1f}",
        label,
        f"{share * 100:.0f}",
    )


# --- capacity accounts --------------------------------------------------------------------------------------


@admin.register(CapacityAccount)
class CapacityAccountAdmin(ReadOnlyAdmin[CapacityAccount]):
    list_display = [
        "label",
        "usage",
        "input_limit_col",
        "input_reserved_col",
        "input_consumed_col",
        "input_available",
        "output_limit_col",
        "output_reserved_col",
        "output_consumed_col",
        "output_available",
        "in_flight_col",
    ]
    list_filter = ["scope", "period", "tenant", "task_class", "pool"]
    search_fields = ["tenant__slug", "tenant__name", "task_class__slug", "pool__slug"]
    change_form_template = "admin/ledger/capacityaccount/change_form.html"
    change_list_template = "admin/tokenbudget/wide_change_list.html"
    fields = ["scope", "tenant", "task_class", "pool", "period", "period_start", "updated_at"]

    def get_queryset(self, request: HttpRequest) -> QuerySet[CapacityAccount]:
        return super().get_queryset(request).select_related("tenant", "task_class", "pool")

    @admin.display(description="account", ordering="id")
    def label(self, obj: CapacityAccount) -> SafeString:
        stale = obj.period_start < period_start_for(obj.period, timezone.now())
        return format_html(
            '<span style="white-space:nowrap">{}</span><br><small class="tb-muted">{} · since {}{}</small>',
            obj,
            obj.period.lower(),
            f"{obj.period_start:%Y-%m-%d}",
            " · roll-over pending" if stale else "",
        )

    @admin.display(description="input limit", ordering="input_limit")
    def input_limit_col(self, obj: CapacityAccount) -> SafeString:
        return _compact(obj.input_limit)

    @admin.display(description="input reserved", ordering="input_reserved")
    def input_reserved_col(self, obj: CapacityAccount) -> SafeString:
        return _compact(obj.input_reserved)

    @admin.display(description="input consumed", ordering="input_consumed")
    def input_consumed_col(self, obj: CapacityAccount) -> SafeString:
        return _compact(obj.input_consumed)

    @admin.display(description="input available")
    def input_available(self, obj: CapacityAccount) -> SafeString:
        return _available(obj.input_limit, obj.input_reserved + obj.input_consumed, compact=True)

    @admin.display(description="output limit", ordering="output_limit")
    def output_limit_col(self, obj: CapacityAccount) -> SafeString:
        return _compact(obj.output_limit)

    @admin.display(description="output reserved", ordering="output_reserved")
    def output_reserved_col(self, obj: CapacityAccount) -> SafeString:
        return _compact(obj.output_reserved)

    @admin.display(description="output consumed", ordering="output_consumed")
    def output_consumed_col(self, obj: CapacityAccount) -> SafeString:
        return _compact(obj.output_consumed)

    @admin.display(description="output available")
    def output_available(self, obj: CapacityAccount) -> SafeString:
        return _available(obj.output_limit, obj.output_reserved + obj.output_consumed, compact=True)

    @admin.display(description="in flight", ordering="in_flight")
    def in_flight_col(self, obj: CapacityAccount) -> str:
        return f"{obj.in_flight:,} / {_n(obj.concurrency_limit)}"

    @admin.display(description="usage")
    def usage(self, obj: CapacityAccount) -> SafeString:
        used = admin_services.used(obj)
        return format_html(
            '<div class="tb-bars">{}{}{}</div>',
            usage_bar("in", used["input"], obj.input_limit),
            usage_bar("out", used["output"], obj.output_limit),
            usage_bar("conc", used["concurrency"], obj.concurrency_limit),
        )

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        account = self.get_object(request, object_id)
        context = dict(extra_context or {})
        if account is not None:
            context.update(
                {
                    "dimensions": _dimensions(account),
                    "increases": TemporaryIncrease.objects.filter(account=account, ended_at__isnull=True),
                    "entries": LedgerEntry.objects.filter(account=account)
                    .select_related("reservation")
                    .order_by("-id")[:25],
                    "changes": recent_changes(account),
                    "can_edit_limits": request.user.has_perm("ledger.change_capacityaccount"),
                    "can_increase": request.user.has_perm("budgeting.add_temporaryincrease"),
                    "can_correct": request.user.has_perm("ledger.add_ledgerentry"),
                }
            )
        return super().change_view(request, object_id, form_url, context)

    def get_urls(self) -> list[URLPattern]:
        wrap = self.admin_site.admin_view
        return [
            path("<int:account_id>/limits/", wrap(self.limits_view), name="ledger_capacityaccount_limits"),
            path(
                "<int:account_id>/increase/", wrap(self.increase_view), name="ledger_capacityaccount_increase"
            ),
            path(
                "<int:account_id>/correction/",
                wrap(self.correction_view),
                name="ledger_capacityaccount_correction",
            ),
            *super().get_urls(),
        ]

    def _account(self, request: HttpRequest, account_id: int) -> CapacityAccount:
        account = self.get_object(request, str(account_id))
        if account is None:
            raise PermissionDenied
        return account

    def _two_step(
        self,
        request: HttpRequest,
        account: CapacityAccount,
        form_class: type[StepForm],
        *,
        title: str,
        lead: str,
        submit: str,
        preview: Callable[[dict[str, Any]], tuple[list[tuple[str, Any, Any, bool]], list[str]]],
        apply: Callable[[dict[str, Any]], str],
        initial: dict[str, Any],
        edit_context: dict[str, Any] | None = None,
        needs_acknowledgement: Callable[[dict[str, Any]], bool] = lambda data: False,
    ) -> HttpResponse:
        """Form, then confirmation page (what changes, warnings), then the service call."""
        form = form_class(request.POST or None, initial=initial)
        if request.method == "POST" and form.is_valid():
            data = form.cleaned_data
            rows, warnings = preview(data)
            acknowledged = not needs_acknowledgement(data) or data.get("acknowledge")
            if data["step"] == "confirm" and acknowledged:
                try:
                    done = apply(data)
                except Problem as problem:
                    messages.error(request, f"{problem.title}: {problem.detail}")
                    return HttpResponseRedirect(request.path)
                messages.success(request, done)
                return HttpResponseRedirect(change_url(account))
            confirm = form_class(initial={**data, "step": "confirm"})
            if data["step"] == "confirm" and not acknowledged:
                warnings = [*warnings, "Tick the box to confirm you mean to go below current use."]
            return confirm_page(
                request,
                self,
                obj=account,
                title=title,
                lead=lead,
                form=confirm,
                submit=submit,
                cancel_url=change_url(account),
                rows=rows,
                warnings=warnings,
                hidden_form=True,
                visible=["acknowledge"] if needs_acknowledgement(data) else [],
                danger=bool(warnings),
            )
        return TemplateResponse(
            request,
            "admin/tokenbudget/edit.html",
            {
                **self.admin_site.each_context(request),
                "opts": self.model._meta,
                "original": account,
                "title": title,
                "lead": lead,
                "form": form,
                "cancel_url": change_url(account),
                "dimensions": _dimensions(account),
                **(edit_context or {}),
            },
        )

    def limits_view(self, request: HttpRequest, account_id: int) -> HttpResponse:
        require(request, "ledger.change_capacityaccount")
        account = self._account(request, account_id)
        current = (account.input_limit, account.output_limit, account.concurrency_limit)

        def preview(data: dict[str, Any]) -> tuple[list[tuple[str, Any, Any, bool]], list[str]]:
            dims = admin_services.preview_limits(
                account,
                input_limit=data["input_limit"],
                output_limit=data["output_limit"],
                concurrency_limit=data["concurrency_limit"],
            )
            return _limit_rows(dims), _limit_warnings(dims)

        def apply(data: dict[str, Any]) -> str:
            admin_services.set_account_limits(
                account_id=account.pk,
                input_limit=data["input_limit"],
                output_limit=data["output_limit"],
                concurrency_limit=data["concurrency_limit"],
                expected=(data["expected_input"], data["expected_output"], data["expected_concurrency"]),
                reason=data["reason"],
                actor=actor(request),
            )
            return f"Limits of {account} saved."

        def below_use(data: dict[str, Any]) -> bool:
            return any(
                d.below_use and d.changed
                for d in admin_services.preview_limits(
                    account,
                    input_limit=data["input_limit"],
                    output_limit=data["output_limit"],
                    concurrency_limit=data["concurrency_limit"],
                )
            )

        return self._two_step(
            request,
            account,
            LimitsForm,
            title=f"Edit limits of {account}",
            lead="Empty means unlimited. The preview shows what is left for new requests; lowering a limit "
            "below current use is allowed (running calls are not affected) but new requests are refused "
            "until usage falls or the period rolls over.",
            submit="Save limits",
            preview=preview,
            apply=apply,
            initial={
                "input_limit": current[0],
                "output_limit": current[1],
                "concurrency_limit": current[2],
                "expected_input": current[0],
                "expected_output": current[1],
                "expected_concurrency": current[2],
                "step": "edit",
            },
            edit_context={"live_preview": True},
            needs_acknowledgement=below_use,
        )

    def increase_view(self, request: HttpRequest, account_id: int) -> HttpResponse:
        require(request, "budgeting.add_temporaryincrease")
        account = self._account(request, account_id)

        def preview(data: dict[str, Any]) -> tuple[list[tuple[str, Any, Any, bool]], list[str]]:
            rows: list[tuple[str, Any, Any, bool]] = []
            warnings = []
            for name, limit, extra in (
                ("input limit", account.input_limit, data["input_tokens"]),
                ("output limit", account.output_limit, data["output_tokens"]),
                ("concurrency limit", account.concurrency_limit, data["concurrency"]),
            ):
                if extra and limit is None:
                    warnings.append(f"{name} is unlimited: there is nothing to increase.")
                rows.append((name, _n(limit), _n(None if limit is None else limit + extra), False))
            rows.append(("until", "", f"{data['expires_at']:%Y-%m-%d %H:%M} UTC", False))
            return rows, warnings

        def apply(data: dict[str, Any]) -> str:
            admin_services.grant_temporary_increase(
                account_id=account.pk,
                input_tokens=data["input_tokens"],
                output_tokens=data["output_tokens"],
                concurrency=data["concurrency"],
                expires_at=data["expires_at"],
                reason=data["reason"],
                actor=actor(request),
                now=timezone.now(),
            )
            return f"Temporary increase on {account} granted until {data['expires_at']:%Y-%m-%d %H:%M} UTC."

        return self._two_step(
            request,
            account,
            IncreaseForm,
            title=f"Temporary increase on {account}",
            lead="The amounts are added to the limits now and taken off again at the expiry.",
            submit="Grant increase",
            preview=preview,
            apply=apply,
            initial={"input_tokens": 0, "output_tokens": 0, "concurrency": 0, "step": "edit"},
        )

    def correction_view(self, request: HttpRequest, account_id: int) -> HttpResponse:
        require(request, "ledger.add_ledgerentry")
        account = self._account(request, account_id)

        def preview(data: dict[str, Any]) -> tuple[list[tuple[str, Any, Any, bool]], list[str]]:
            new_input = account.input_consumed + data["input_consumed"]
            new_output = account.output_consumed + data["output_consumed"]
            warnings = ["A consumed balance would go negative."] if min(new_input, new_output) < 0 else []
            return [
                ("input consumed", _n(account.input_consumed), _n(new_input), new_input < 0),
                ("output consumed", _n(account.output_consumed), _n(new_output), new_output < 0),
            ], warnings

        def apply(data: dict[str, Any]) -> str:
            entry = admin_services.post_correction(
                account_id=account.pk,
                input_consumed=data["input_consumed"],
                output_consumed=data["output_consumed"],
                reason=data["reason"],
                actor=actor(request),
            )
            return f"Correction #{entry.pk} posted on {account}."

        return self._two_step(
            request,
            account,
            CorrectionForm,
            title=f"Post a correction on {account}",
            lead="A correction is a new ledger entry (negative to give tokens back, positive to charge); "
            "existing entries are never edited. Reserved balances belong to live reservations and cannot be "
            "corrected here.",
            submit="Post correction",
            preview=preview,
            apply=apply,
            initial={"input_consumed": 0, "output_consumed": 0, "step": "edit"},
        )


def _available(limit: int | None, used: int, *, compact: bool = False) -> SafeString:
    if limit is None:
        return format_html("{}", "∞")
    left = limit - used
    if left < 0:
        return format_html('<span class="tb-neg" title="over the limit">{}</span>', f"{left:,}")
    return _compact(left) if compact else format_html("{}", f"{left:,}")


@dataclass(frozen=True)
class Dimension:
    name: str
    limit: int | None
    reserved: int
    consumed: int
    used: int
    bar: SafeString

    @property
    def available(self) -> SafeString:
        return _available(self.limit, self.used)

    @property
    def limit_text(self) -> str:
        return _n(self.limit)

    @property
    def reserved_text(self) -> str:
        return _n(self.reserved)

    @property
    def consumed_text(self) -> str:
        return _n(self.consumed)

    @property
    def used_text(self) -> str:
        return _n(self.used)


def _dimensions(account: CapacityAccount) -> list[Dimension]:
    return [
        Dimension(
            "input",
            account.input_limit,
            account.input_reserved,
            account.input_consumed,
            account.input_reserved + account.input_consumed,
            usage_bar("input", account.input_reserved + account.input_consumed, account.input_limit),
        ),
        Dimension(
            "output",
            account.output_limit,
            account.output_reserved,
            account.output_consumed,
            account.output_reserved + account.output_consumed,
            usage_bar("output", account.output_reserved + account.output_consumed, account.output_limit),
        ),
        Dimension(
            "concurrency",
            account.concurrency_limit,
            account.in_flight,
            0,
            account.in_flight,
            usage_bar("concurrency", account.in_flight, account.concurrency_limit),
        ),
    ]


def _limit_rows(dims: list[DimensionPreview]) -> list[tuple[str, Any, Any, bool]]:
    rows: list[tuple[str, Any, Any, bool]] = []
    for d in dims:
        rows.append((f"{d.name} limit", _n(d.old_limit), _n(d.new_limit), False))
        rows.append(
            (f"{d.name} available (in use {d.used:,})", _n(d.old_available), _n(d.new_available), d.below_use)
        )
    return rows


def _limit_warnings(dims: list[DimensionPreview]) -> list[str]:
    return [
        f"The new {d.name} limit ({d.new_limit:,}) is below current use ({d.used:,}): new requests will be "
        "refused on this account until usage falls or the period rolls over."
        for d in dims
        if d.below_use and d.changed and d.new_limit is not None
    ]


class StepForm(ReasonForm):
    """A form shown twice: to edit (step=edit) and, with its fields hidden, to confirm (step=confirm)."""

    step = forms.ChoiceField(choices=[("edit", "edit"), ("confirm", "confirm")], widget=forms.HiddenInput)


class OptionalInt(forms.IntegerField):
    """An optional non-negative integer limit; empty means unlimited."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(required=False, min_value=0, **kwargs)


class LimitsForm(StepForm):
    input_limit = OptionalInt(label="Input tokens per period")
    output_limit = OptionalInt(label="Output tokens per period")
    concurrency_limit = OptionalInt(label="Concurrent requests")
    expected_input = OptionalInt(widget=forms.HiddenInput)
    expected_output = OptionalInt(widget=forms.HiddenInput)
    expected_concurrency = OptionalInt(widget=forms.HiddenInput)
    acknowledge = forms.BooleanField(
        required=False, label="I understand that new requests will be refused on this account"
    )
    field_order = ["input_limit", "output_limit", "concurrency_limit", "reason"]


class IncreaseForm(StepForm):
    input_tokens = forms.IntegerField(min_value=0, label="Extra input tokens")
    output_tokens = forms.IntegerField(min_value=0, label="Extra output tokens")
    concurrency = forms.IntegerField(min_value=0, label="Extra concurrent requests")
    expires_at = forms.DateTimeField(
        label="Expires at (UTC)", widget=forms.DateTimeInput(attrs={"type": "datetime-local"})
    )
    field_order = ["input_tokens", "output_tokens", "concurrency", "expires_at", "reason"]

    def clean_expires_at(self) -> datetime:
        value: datetime = self.cleaned_data["expires_at"]
        if value <= timezone.now():
            raise forms.ValidationError("must be in the future")
        return value

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        if not any(data.get(k) for k in ("input_tokens", "output_tokens", "concurrency")):
            raise forms.ValidationError("Increase at least one dimension.")
        return data


class CorrectionForm(StepForm):
    input_consumed = forms.IntegerField(label="Input consumed (±tokens)")
    output_consumed = forms.IntegerField(label="Output consumed (±tokens)")
    field_order = ["input_consumed", "output_consumed", "reason"]

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        if not data.get("input_consumed") and not data.get("output_consumed"):
            raise forms.ValidationError("A correction must change input or output consumed.")
        return data


# --- reservations -------------------------------------------------------------------------------------------


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
        items.append(
            TimelineItem(
                entry.created_at,
                label,
                detail,
                "ledger",
            )
        )
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

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        reservation = self.get_object(request, object_id)
        context = dict(extra_context or {})
        if reservation is not None:
            context.update(
                {
                    "reservation": reservation,
                    "timeline": timeline(reservation),
                    "holds": reservation.holds.select_related(
                        "account__tenant", "account__task_class", "account__pool"
                    ),
                    "entries": reservation.entries.select_related("account").order_by("id"),
                    "usage_events": reservation.usage_events.order_by("id"),
                    "top_ups": reservation.top_up_records.order_by("created_at"),
                    "lease_over": reservation.state in {State.SETTLED, State.REJECTED},
                    "lease_expired": bool(
                        reservation.lease_expires_at and reservation.lease_expires_at < timezone.now()
                    ),
                    "can_view_manifest": request.user.has_perm("budgeting.view_manifest"),
                    **(manifest_context(reservation.manifest) if reservation.manifest else {}),
                }
            )
        return super().change_view(request, object_id, form_url, context)

    def get_urls(self) -> list[URLPattern]:
        wrap = self.admin_site.admin_view
        return [
            path("reconciling/", wrap(self.backlog_view), name="ledger_reservation_backlog"),
            *super().get_urls(),
        ]

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
        backlog = reports.reconciling_backlog(now)
        return TemplateResponse(
            request,
            "admin/ledger/reservation/backlog.html",
            {
                **self.admin_site.each_context(request),
                "opts": self.model._meta,
                "title": "Reconciling backlog",
                "rows": rows,
                "backlog": backlog,
                "oldest": age_text(backlog["oldestAgeSeconds"])
                if backlog["oldestAgeSeconds"] is not None
                else "—",
                "chart": backlog_chart(backlog),
                "billing_url": _billing_url(),
            },
        )


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


def _billing_url() -> str:
    return reverse("admin:reconciliation_billingimport_changelist")


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
        if obj.reservation_id is None:
            return "—"
        return format_html(
            '<a href="{}">{}</a>',
            reverse("admin:ledger_reservation_change", args=[obj.reservation_id]),
            str(obj.reservation_id)[:8],
        )
