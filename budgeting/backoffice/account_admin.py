"""The capacity accounts' admin: balances at a glance, and the three changes an account's page offers (edit
limits, grant a temporary increase, post a correction), plus the list of temporary increases.

Balances change only through ``ledger.services.limits``: each change is a form, then a confirmation page
showing its effect, then one service call.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from decimal import Decimal
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString

from budgeting.backoffice.account_display import (
    available_figure,
    dimensions,
    limit_rows,
    limit_warnings,
    shown_as,
    usage_bar,
)
from budgeting.backoffice.formats import CountField, MoneyField, count, signed, signed_micro_money
from budgeting.backoffice.kit import (
    ReadOnlyAdmin,
    ReasonForm,
    Row,
    StepForm,
    actor,
    admin_page,
    change_url,
    figure_column,
    link,
    recent_changes,
    require,
    two_step_page,
)
from budgeting.backoffice.reports.spend import RUN_RATE_DAYS, account_spend
from budgeting.catalog.models import TemporaryIncrease
from budgeting.catalog.prices import from_micro, to_micro
from ledger.models import CapacityAccount, LedgerEntry
from ledger.periods import period_start_for
from ledger.services import limits


def _micro(amount: Decimal | None) -> int | None:
    """A money amount the form read (at most micro-unit precision) in the micro-units the ledger keeps."""
    return None if amount is None else to_micro(amount)


class OptionalLimit(CountField):
    """An optional non-negative limit, typed with or without separators; empty means unlimited."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(required=False, min_value=0, **kwargs)


class LimitsForm(StepForm):
    """The limits edit; ``limits_form`` adds the spend limit in the account's currency."""

    input_limit = OptionalLimit(label="Permanent input tokens per period")
    output_limit = OptionalLimit(label="Permanent output tokens per period")
    concurrency_limit = OptionalLimit(label="Permanent concurrent requests")
    # The limits in force the person saw (spend in micro-units), for the service's compare-and-swap.
    expected_input = OptionalLimit(widget=forms.HiddenInput)
    expected_output = OptionalLimit(widget=forms.HiddenInput)
    expected_concurrency = OptionalLimit(widget=forms.HiddenInput)
    expected_spend = OptionalLimit(widget=forms.HiddenInput)
    acknowledge = forms.BooleanField(
        required=False, label="I understand that new requests will be refused on this account"
    )
    field_order = ["input_limit", "output_limit", "concurrency_limit", "spend_limit", "reason"]


def limits_form(currency: str) -> type[LimitsForm]:
    """The limits form of an account kept in ``currency``: its spend limit is an amount of that currency."""

    class AccountLimitsForm(LimitsForm):
        spend_limit = MoneyField(
            currency=currency,
            required=False,
            label=f"Permanent spend per period ({currency})",
            help_text=f"An amount in {currency}, e.g. 5,000.00; empty means no spend limit (spend is still "
            "tracked).",
        )

    return AccountLimitsForm


class IncreaseForm(StepForm):
    """A temporary increase; ``increase_form`` adds its spend in the account's currency."""

    input_tokens = CountField(min_value=0, label="Extra input tokens")
    output_tokens = CountField(min_value=0, label="Extra output tokens")
    concurrency = CountField(min_value=0, label="Extra concurrent requests")
    expires_at = forms.DateTimeField(
        label="Expires at (UTC)", widget=forms.DateTimeInput(attrs={"type": "datetime-local"})
    )
    field_order = ["input_tokens", "output_tokens", "concurrency", "spend", "expires_at", "reason"]

    def clean_expires_at(self) -> datetime:
        value: datetime = self.cleaned_data["expires_at"]
        if value <= timezone.now():
            raise forms.ValidationError("The expiry must be in the future.")
        return value

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        if not any(data.get(k) for k in ("input_tokens", "output_tokens", "concurrency", "spend")):
            raise forms.ValidationError("Increase at least one dimension.")
        return data


def increase_form(currency: str) -> type[IncreaseForm]:
    """The temporary increase form of an account kept in ``currency``: extra spend is an amount of it."""

    class AccountIncreaseForm(IncreaseForm):
        spend = MoneyField(
            currency=currency,
            required=False,
            label=f"Extra spend per period ({currency})",
            help_text=f"An amount in {currency}, e.g. 500.00; empty adds none.",
        )

    return AccountIncreaseForm


class CorrectionForm(StepForm):
    input_consumed = CountField(label="Input consumed (± tokens)")
    output_consumed = CountField(label="Output consumed (± tokens)")
    field_order = ["input_consumed", "output_consumed", "reason"]

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        if not data.get("input_consumed") and not data.get("output_consumed"):
            raise forms.ValidationError("A correction must change input or output consumed.")
        return data


def _available_column(dimension: str) -> Callable[[Any, CapacityAccount], SafeString]:
    """A list column showing what is left of a dimension's limit for new requests."""

    def column(model_admin: Any, obj: CapacityAccount) -> SafeString:
        used = getattr(obj, f"{dimension}_reserved") + getattr(obj, f"{dimension}_consumed")
        left = available_figure(getattr(obj, f"{dimension}_limit"), used)
        return format_html('<div class="tb-num">{}</div>', left)

    return admin.display(description=f"{dimension} available (tokens)")(column)


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
    # Not the row's updated_at: balances move in one SQL statement per request, which auto_now never sees.
    fields = [
        "scope",
        "tenant",
        "task_class",
        "pool",
        "period",
        "period_start",
        "currency",
        "last_movement",
        "last_change",
    ]

    input_limit_col = figure_column("input_limit", "input limit (tokens)")
    input_reserved_col = figure_column("input_reserved", "input reserved (tokens)")
    input_consumed_col = figure_column("input_consumed", "input consumed (tokens)")
    input_available = _available_column("input")
    output_limit_col = figure_column("output_limit", "output limit (tokens)")
    output_reserved_col = figure_column("output_reserved", "output reserved (tokens)")
    output_consumed_col = figure_column("output_consumed", "output consumed (tokens)")
    output_available = _available_column("output")

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

    @admin.display(description="requests in flight / limit", ordering="in_flight")
    def in_flight_col(self, obj: CapacityAccount) -> SafeString:
        return format_html(
            '<div class="tb-num">{} / {}</div>', count(obj.in_flight), count(obj.concurrency_limit)
        )

    @admin.display(description="usage")
    def usage(self, obj: CapacityAccount) -> SafeString:
        used = limits.used(obj)
        return format_html(
            '<div class="tb-bars">{}{}{}{}</div>',
            usage_bar("in", used["input"], obj.input_limit),
            usage_bar("out", used["output"], obj.output_limit),
            usage_bar("conc", used["concurrency"], obj.concurrency_limit),
            usage_bar("spend", used["spend"], obj.spend_limit, shown_as("spend", obj.currency)),
        )

    @admin.display(description="last balance movement")
    def last_movement(self, obj: CapacityAccount) -> str:
        entry = LedgerEntry.objects.filter(account=obj).order_by("-id").first()
        if entry is None:
            return "none yet"
        return f"{entry.created_at:%Y-%m-%d %H:%M:%S} UTC ({entry.get_kind_display()}, entry #{entry.pk})"

    @admin.display(description="last change by a person")
    def last_change(self, obj: CapacityAccount) -> str:
        change = recent_changes(obj, limit=1).first()
        if change is None:
            return "none"
        return f"{change.at:%Y-%m-%d %H:%M:%S} UTC ({change.action} by {change.actor_username})"

    def page_context(self, request: HttpRequest, obj: CapacityAccount) -> dict[str, Any]:
        return {
            "dimensions": dimensions(obj, limits.active_increases(obj)),
            "increases": TemporaryIncrease.objects.filter(account=obj, ended_at__isnull=True),
            "entries": LedgerEntry.objects.filter(account=obj)
            .select_related("reservation")
            .order_by("-id")[:25],
            "changes": recent_changes(obj),
            "spend": account_spend(obj, timezone.now()),
            "run_rate_days": RUN_RATE_DAYS,
            "can_edit_limits": request.user.has_perm("ledger.change_capacityaccount"),
            "can_increase": request.user.has_perm("budgeting.add_temporaryincrease"),
            "can_correct": request.user.has_perm("ledger.add_ledgerentry"),
        }

    def page_urls(self) -> list[tuple[str, Callable[..., HttpResponse], str]]:
        return [
            ("<int:account_id>/limits/", self.limits_view, "ledger_capacityaccount_limits"),
            ("<int:account_id>/increase/", self.increase_view, "ledger_capacityaccount_increase"),
            ("<int:account_id>/correction/", self.correction_view, "ledger_capacityaccount_correction"),
        ]

    def limits_view(self, request: HttpRequest, account_id: int) -> HttpResponse:
        require(request, "ledger.change_capacityaccount")
        account = self.object_or_404(request, account_id)
        current = limits.limits_in_force(account)
        # The form edits the permanent limits; active temporary increases are shown apart and stay on top.
        increases = limits.active_increases(account)
        permanent = [
            None if limit is None else limit - increases[name]
            for name, limit in zip(limits.DIMENSIONS, current, strict=True)
        ]

        def previewed(data: dict[str, Any]) -> list[limits.DimensionPreview]:
            return limits.preview_permanent_limits(
                account,
                input_limit=data["input_limit"],
                output_limit=data["output_limit"],
                concurrency_limit=data["concurrency_limit"],
                spend_limit=_micro(data["spend_limit"]),
                increases=increases,
            )

        def preview(data: dict[str, Any]) -> tuple[list[Row], list[str]]:
            dims = previewed(data)
            return limit_rows(dims, account.currency), limit_warnings(dims, account.currency)

        def apply(data: dict[str, Any]) -> str:
            limits.set_permanent_limits(
                account_id=account.pk,
                input_limit=data["input_limit"],
                output_limit=data["output_limit"],
                concurrency_limit=data["concurrency_limit"],
                spend_limit=_micro(data["spend_limit"]),
                expected=(
                    data["expected_input"],
                    data["expected_output"],
                    data["expected_concurrency"],
                    data["expected_spend"],
                ),
                reason=data["reason"],
                actor=actor(request),
            )
            return f"Limits of {account} saved."

        active = TemporaryIncrease.objects.filter(account=account, ended_at__isnull=True)
        return two_step_page(
            request,
            self,
            account,
            limits_form(account.currency),
            title=f"Edit limits of {account}",
            lead="These are the account's permanent limits; empty means unlimited. The spend limit is an "
            f"amount in {account.currency} per period, held with the tokens at the prices in force. "
            + (
                "Its active temporary increases (below) stay on top of them and end by themselves. "
                if any(increases.values())
                else ""
            )
            + "The preview shows what is left for new requests; lowering a limit below current use is "
            "allowed (running calls are not affected) but new requests are refused until usage falls or the "
            "period rolls over.",
            submit="Save limits",
            preview=preview,
            apply=apply,
            initial={
                "input_limit": permanent[0],
                "output_limit": permanent[1],
                "concurrency_limit": permanent[2],
                "spend_limit": None if permanent[3] is None else from_micro(permanent[3]),
                "expected_input": current[0],
                "expected_output": current[1],
                "expected_concurrency": current[2],
                "expected_spend": current[3],
                "step": "edit",
            },
            edit_context={
                "dimensions": dimensions(account, increases),
                "live_preview": True,
                "increases": active,
            },
            needs_acknowledgement=lambda data: any(d.below_use and d.changed for d in previewed(data)),
        )

    def increase_view(self, request: HttpRequest, account_id: int) -> HttpResponse:
        require(request, "budgeting.add_temporaryincrease")
        account = self.object_or_404(request, account_id)

        def preview(data: dict[str, Any]) -> tuple[list[Row], list[str]]:
            rows: list[Row] = []
            warnings = []
            for name, limit, extra, show in (
                ("input limit (tokens)", account.input_limit, data["input_tokens"], count),
                ("output limit (tokens)", account.output_limit, data["output_tokens"], count),
                ("concurrency limit (requests)", account.concurrency_limit, data["concurrency"], count),
                (
                    f"spend limit ({account.currency})",
                    account.spend_limit,
                    _micro(data["spend"]) or 0,
                    shown_as("spend", account.currency),
                ),
            ):
                if extra and limit is None:
                    warnings.append(f"{name} is unlimited: there is nothing to increase.")
                rows.append((name, show(limit), show(None if limit is None else limit + extra), False))
            rows.append(("until", "", f"{data['expires_at']:%Y-%m-%d %H:%M} UTC", False))
            return rows, warnings

        def apply(data: dict[str, Any]) -> str:
            limits.grant_temporary_increase(
                account_id=account.pk,
                input_tokens=data["input_tokens"],
                output_tokens=data["output_tokens"],
                concurrency=data["concurrency"],
                spend=_micro(data["spend"]) or 0,
                expires_at=data["expires_at"],
                reason=data["reason"],
                actor=actor(request),
                now=timezone.now(),
            )
            return f"Temporary increase on {account} granted until {data['expires_at']:%Y-%m-%d %H:%M} UTC."

        return two_step_page(
            request,
            self,
            account,
            increase_form(account.currency),
            title=f"Temporary increase on {account}",
            lead="The amounts are added to the limits now and taken off again at the expiry.",
            submit="Grant increase",
            preview=preview,
            apply=apply,
            initial={"input_tokens": 0, "output_tokens": 0, "concurrency": 0, "step": "edit"},
            edit_context={"dimensions": dimensions(account)},
        )

    def correction_view(self, request: HttpRequest, account_id: int) -> HttpResponse:
        require(request, "ledger.add_ledgerentry")
        account = self.object_or_404(request, account_id)

        def preview(data: dict[str, Any]) -> tuple[list[Row], list[str]]:
            new_input = account.input_consumed + data["input_consumed"]
            new_output = account.output_consumed + data["output_consumed"]
            warnings = ["A consumed balance would go negative."] if min(new_input, new_output) < 0 else []
            return [
                ("input consumed (tokens)", count(account.input_consumed), count(new_input), new_input < 0),
                (
                    "output consumed (tokens)",
                    count(account.output_consumed),
                    count(new_output),
                    new_output < 0,
                ),
            ], warnings

        def apply(data: dict[str, Any]) -> str:
            entry = limits.post_correction(
                account_id=account.pk,
                input_consumed=data["input_consumed"],
                output_consumed=data["output_consumed"],
                reason=data["reason"],
                actor=actor(request),
            )
            return f"Correction #{entry.pk} posted on {account}."

        return two_step_page(
            request,
            self,
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
            edit_context={"dimensions": dimensions(account)},
        )


@admin.register(TemporaryIncrease)
class TemporaryIncreaseAdmin(ReadOnlyAdmin[TemporaryIncrease]):
    """Granted from an account's page; here they are listed, revoked early, or ended when due."""

    list_display = [
        "account_link",
        "input_col",
        "output_col",
        "concurrency_col",
        "spend_col",
        "starts_col",
        "expires_col",
        "status",
        "created_by",
        "reason",
    ]
    list_filter = [("ended_at", admin.EmptyFieldListFilter), "expires_at"]
    change_list_template = "admin/tokenbudget/wide_change_list.html"
    search_fields = ["reason", "created_by", "account__tenant__slug", "account__pool__slug"]
    actions = ["revoke", "end_expired"]
    list_select_related = ["account__tenant", "account__task_class", "account__pool"]
    fields = [
        "account",
        "input_tokens",
        "output_tokens",
        "concurrency",
        "spend_col",
        "starts_at",
        "expires_at",
        "reason",
        "created_by",
        "ended_at",
        "end_reason",
    ]

    @admin.display(description="account")
    def account_link(self, obj: TemporaryIncrease) -> str:
        return link(change_url(obj.account), obj.account)

    @admin.display(description="extra input tokens", ordering="input_tokens")
    def input_col(self, obj: TemporaryIncrease) -> str:
        return signed(obj.input_tokens)

    @admin.display(description="extra output tokens", ordering="output_tokens")
    def output_col(self, obj: TemporaryIncrease) -> str:
        return signed(obj.output_tokens)

    @admin.display(description="extra concurrent requests", ordering="concurrency")
    def concurrency_col(self, obj: TemporaryIncrease) -> str:
        return signed(obj.concurrency)

    @admin.display(description="extra spend", ordering="spend")
    def spend_col(self, obj: TemporaryIncrease) -> str:
        return signed_micro_money(obj.spend, obj.account.currency)

    @admin.display(description="starts at", ordering="starts_at")
    def starts_col(self, obj: TemporaryIncrease) -> str:
        return f"{timezone.localtime(obj.starts_at):%Y-%m-%d %H:%M}"

    @admin.display(description="expires at", ordering="expires_at")
    def expires_col(self, obj: TemporaryIncrease) -> str:
        return f"{timezone.localtime(obj.expires_at):%Y-%m-%d %H:%M}"

    @admin.display(description="status")
    def status(self, obj: TemporaryIncrease) -> str:
        if obj.ended_at is None:
            return "active" if obj.expires_at > timezone.now() else "due to end"
        return f"ended {timezone.localtime(obj.ended_at):%Y-%m-%d %H:%M} ({obj.end_reason})"

    def get_actions(self, request: HttpRequest) -> dict[str, Any]:
        actions = super().get_actions(request)
        if not request.user.has_perm("budgeting.change_temporaryincrease"):
            actions.pop("revoke", None)
            actions.pop("end_expired", None)
        return actions

    @admin.action(description="Revoke the selected increases now…")
    def revoke(self, request: HttpRequest, queryset: QuerySet[TemporaryIncrease]) -> HttpResponse | None:
        require(request, "budgeting.change_temporaryincrease")
        active = list(queryset.filter(ended_at__isnull=True).select_related("account"))
        form = ReasonForm(request.POST if "reason" in request.POST else None)
        if form.is_valid():
            now = timezone.now()
            ended = sum(
                limits.end_temporary_increase(
                    increase_id=i.pk,
                    reason=f"revoked: {form.cleaned_data['reason']}",
                    actor=actor(request),
                    now=now,
                )
                for i in active
            )
            messages.success(request, f"{ended} temporary increase(s) revoked; their limits are taken back.")
            return None
        return admin_page(
            request,
            self,
            "admin/tokenbudget/action_confirm.html",
            {
                "title": "Revoke temporary increases",
                "lead": "The increases end now and their amounts are taken off the accounts' limits.",
                "objects": active,
                "form": form,
                "action": "revoke",
                "submit": "Revoke",
                "danger": True,
            },
        )

    @admin.action(description="End the increases whose expiry has passed")
    def end_expired(self, request: HttpRequest, queryset: QuerySet[TemporaryIncrease]) -> None:
        require(request, "budgeting.change_temporaryincrease")
        ended = limits.expire_temporary_increases(now=timezone.now())
        messages.success(request, f"{ended} expired increase(s) ended.")
