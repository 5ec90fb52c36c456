"""The catalog's admin: tenants, task classes, pools, tokenizers, model revisions, service clients with their
tokens, and prices.

Each is edited with a form that asks for a reason, and every save lands in the change log. Issuing and
revoking a service client's tokens are buttons that open a confirmation page and make one service call.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from django import forms
from django.conf import settings
from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import mark_safe

from budgeting.admission import drift
from budgeting.backoffice import formats
from budgeting.backoffice.kit import (
    AuditedAdmin,
    AuditedForm,
    ReadOnly,
    ReasonForm,
    actor,
    admin_page,
    change_url,
    confirm_page,
    figure_column,
    require,
)
from budgeting.catalog import tokens
from budgeting.catalog.models import (
    CAPABILITIES,
    TEMPLATE_FAMILIES,
    ApiToken,
    ModelPool,
    ModelRevision,
    Price,
    ServiceClient,
    TaskClass,
    Tenant,
    Tokenizer,
)
from budgeting.catalog.prices import add_price
from budgeting.catalog.snapshot import current as current_snapshot
from budgeting.catalog.tokenizer_assets import sha256_file
from budgeting.provisioning.document import ENV_NAME
from ladder.families import FAMILIES


@admin.register(Tenant)
class TenantAdmin(AuditedAdmin[Tenant]):
    list_display = ["slug", "name", "internal", "rollout_mode", "created_at"]
    list_filter = ["internal", "rollout_mode"]
    search_fields = ["slug", "name"]
    fields = ["slug", "name", "internal", "rollout_mode"]


@admin.register(TaskClass)
class TaskClassAdmin(AuditedAdmin[TaskClass]):
    list_display = [
        "slug",
        "input_cap_col",
        "max_output_cap_col",
        "queue_allowed",
        "queue_deadline_seconds",
        "ramp_percent",
    ]
    input_cap_col = figure_column("input_cap", "input cap (tokens)")
    max_output_cap_col = figure_column("max_output_cap", "output cap (tokens)")
    list_filter = ["queue_allowed"]
    search_fields = ["slug", "description"]
    fields = [
        "slug",
        "description",
        "input_cap",
        "max_output_cap",
        "queue_allowed",
        "queue_deadline_seconds",
        "ramp_percent",
        "tenant_account_defaults",
    ]


class ModelPoolForm(AuditedForm):
    """The key fields name environment variables: a key pasted in by mistake is refused before it reaches the
    database and the change log."""

    class Meta:
        model = ModelPool
        fields = [
            "slug",
            "region",
            "provider",
            "adapter",
            "provider_base_url",
            "api_key_env",
            "admin_key_env",
            "max_call_seconds",
        ]

    def _env_name(self, name: str) -> str:
        value = str(self.cleaned_data[name])
        if value and not ENV_NAME.fullmatch(value):
            raise forms.ValidationError(
                "Enter the name of an environment variable (letters, digits and _), never the key itself."
            )
        return value

    def clean_api_key_env(self) -> str:
        return self._env_name("api_key_env")

    def clean_admin_key_env(self) -> str:
        return self._env_name("admin_key_env")


@admin.register(ModelPool)
class ModelPoolAdmin(AuditedAdmin[ModelPool]):
    form = ModelPoolForm
    list_display = tuple(ModelPoolForm.Meta.fields)
    list_filter = ["provider", "adapter"]
    search_fields = ["slug", "region"]


class TokenizerForm(AuditedForm):
    """The digest and the upper-bound rule are read from the file, never typed: saving after the file under
    TOKENIZER_DIR was replaced records the new digest (a hot swap)."""

    class Meta:
        model = Tokenizer
        fields = ["name", "family", "source", "file_name", "nfkc"]

    def clean_file_name(self) -> str:
        name = str(self.cleaned_data["file_name"])
        folder = Path(settings.TOKENIZER_DIR).resolve()
        file = (folder / name).resolve()
        if file.parent != folder or not file.is_file():
            raise forms.ValidationError(f"no file {name!r} in {folder}")
        family = FAMILIES.get(str(self.cleaned_data.get("family", "")))
        if family is None:
            raise forms.ValidationError("choose the tokenizer family first")
        try:
            rule = family.bound_rule(file.read_bytes())
        except ValueError:
            raise forms.ValidationError(f"{name} is not a {family.name} tokenizer file") from None
        self.instance.digest = "sha256:" + sha256_file(file)
        self.instance.upper_bound_rule = rule or ""
        return name


@admin.register(Tokenizer)
class TokenizerAdmin(AuditedAdmin[Tokenizer]):
    form = TokenizerForm
    list_display = ["name", "family", "file_name", "short_digest", "nfkc", "upper_bound_rule"]
    search_fields = ["name", "digest"]
    readonly_fields = ["digest", "upper_bound_rule", "created_at"]

    @admin.display(description="digest")
    def short_digest(self, obj: Tokenizer) -> str:
        return obj.digest[:19] + "…"


class ModelRevisionForm(AuditedForm):
    class Meta:
        model = ModelRevision
        fields = [
            "name",
            "tokenizer",
            "pools",
            "context_window",
            "max_output",
            "template_family",
            "image_formula",
            "capabilities",
            "data_residency",
            "safety_tier",
            "counter",
            "provider_model",
        ]

    def clean_capabilities(self) -> list[str]:
        value = self.cleaned_data["capabilities"]
        if not isinstance(value, list) or any(c not in CAPABILITIES for c in value):
            raise forms.ValidationError(f"a list drawn from {sorted(CAPABILITIES)}")
        return sorted(set(value))

    def clean_template_family(self) -> str:
        value = str(self.cleaned_data["template_family"])
        if value not in TEMPLATE_FAMILIES:
            raise forms.ValidationError(f"one of {sorted(TEMPLATE_FAMILIES)}")
        return value


@admin.register(ModelRevision)
class ModelRevisionAdmin(AuditedAdmin[ModelRevision]):
    form = ModelRevisionForm
    list_display = [
        "name",
        "tokenizer",
        "context_window_col",
        "max_output_col",
        "template_family",
        "data_residency",
        "safety_tier",
        "counter",
        "pool_list",
    ]
    list_filter = ["template_family", "data_residency", "pools"]
    context_window_col = figure_column("context_window", "context window (tokens)")
    max_output_col = figure_column("max_output", "maximum output (tokens)")
    search_fields = ["name"]
    filter_horizontal = ["pools"]
    readonly_fields = ["counter_drift"]

    def get_queryset(self, request: HttpRequest) -> QuerySet[ModelRevision]:
        return super().get_queryset(request).select_related("tokenizer").prefetch_related("pools")

    @admin.display(description="pools")
    def pool_list(self, obj: ModelRevision) -> str:
        return ", ".join(p.slug for p in obj.pools.all())

    @admin.display(description="counter drift (settled calls)")
    def counter_drift(self, obj: ModelRevision) -> str:
        """Each counter's drift from the providers' reports, flagged when out of the policy's bound."""
        if obj.pk is None:
            return "—"
        policy = current_snapshot()[0].policy
        bound = None if policy is None else policy.counter_drift
        found = drift.statuses(bound, model_revision=obj.name)
        if not found:
            return "no settled call with a provider-reported input yet"
        return format_html_join(
            mark_safe("<br>"),
            "{}: p50 {} · p99 {} over {} calls — {}",
            (
                (
                    status.count_method,
                    f"{status.p50:.2%}",
                    f"{status.p99:.2%}",
                    status.calls,
                    _drift_verdict(status),
                )
                for status in found
            ),
        )


def _drift_verdict(status: drift.DriftStatus) -> str:
    if status.exceeded:
        assert status.bound is not None
        fallback = " (counting unavailable: the policy falls back)" if status.falls_back else ""
        return f"OUT OF BOUND (p99 ≤ {status.bound.max_p99:.2%}){fallback}"
    if status.bounded:
        return "within bound"
    if status.bound is None:
        return "no bound in the policy"
    if status.count_method not in drift.BOUNDED_METHODS:
        return "a bound overcounts by design: not bounded"
    return f"fewer than {status.bound.min_calls} calls: no verdict yet"


class ApiTokenInline(ReadOnly, admin.TabularInline[ApiToken, ServiceClient]):
    model = ApiToken
    extra = 0
    fields = ("name", "prefix", "created_at", "last_used_at", "expires_at", "revoked_at", "revoke")
    readonly_fields = fields

    @admin.display(description="")
    def revoke(self, token: ApiToken) -> str:
        if token.revoked_at is not None:
            return "revoked"
        url = reverse("admin:budgeting_serviceclient_revoke_token", args=[token.client_id, token.pk])
        expired = token.expires_at is not None and token.expires_at <= timezone.now()
        return format_html('{}<a class="button" href="{}">Revoke…</a>', "expired · " if expired else "", url)


def _when(label: str, help_text: str) -> forms.DateTimeField:
    return forms.DateTimeField(
        required=False,
        label=label,
        help_text=help_text,
        widget=forms.DateTimeInput(attrs={"type": "datetime-local"}, format="%Y-%m-%dT%H:%M"),
    )


class RotateForm(ReasonForm):
    name = forms.CharField(
        required=False, max_length=100, help_text="What the new token is for, e.g. 'gateway eu-1'."
    )
    expires_at = _when("New token expires at (UTC)", "Empty: the new token does not expire.")
    revoke_current = forms.BooleanField(
        required=False, initial=False, label="Revoke the client's current tokens now"
    )
    retire_at = _when(
        "Or retire the current tokens at (UTC)",
        "They keep working until then, so gateways can switch over; empty: they stay until revoked.",
    )
    # One form, one token: the same form posted again (a refresh of the page showing the token, a double
    # click) carries the same key and issues nothing (see ROTATIONS_SEEN).
    once = forms.CharField(widget=forms.HiddenInput, max_length=64)

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        now = timezone.now()
        if data.get("revoke_current") and data.get("retire_at"):
            self.add_error("retire_at", "Revoke the current tokens now, or retire them later: not both.")
        for field in ("expires_at", "retire_at"):
            if data.get(field) and data[field] <= now:
                self.add_error(field, "Choose a time in the future.")
        return data

    def retire_current_at(self, now: datetime) -> datetime | None:
        return now if self.cleaned_data["revoke_current"] else self.cleaned_data["retire_at"]


# The session keeps the keys of the last rotation forms it posted: only keys, never a token.
ROTATIONS_SEEN = "tb-rotations-seen"


@admin.register(ServiceClient)
class ServiceClientAdmin(AuditedAdmin[ServiceClient]):
    list_display = ["name", "is_active", "tenant_list", "active_tokens"]
    list_filter = ["is_active"]
    search_fields = ["name"]
    fields = ["name", "is_active", "tenants"]
    filter_horizontal = ["tenants"]
    inlines = [ApiTokenInline]
    change_form_template = "admin/budgeting/serviceclient/change_form.html"

    def get_queryset(self, request: HttpRequest) -> QuerySet[ServiceClient]:
        return super().get_queryset(request).prefetch_related("tenants", "tokens")

    @admin.display(description="tenants")
    def tenant_list(self, obj: ServiceClient) -> str:
        return ", ".join(t.slug for t in obj.tenants.all())

    @admin.display(description="active tokens")
    def active_tokens(self, obj: ServiceClient) -> int:
        return sum(1 for t in obj.tokens.all() if t.revoked_at is None)

    def page_urls(self) -> list[tuple[str, Callable[..., HttpResponse], str]]:
        return [
            ("<int:client_id>/rotate/", self.rotate_view, "budgeting_serviceclient_rotate"),
            (
                "<int:client_id>/tokens/<int:token_id>/revoke/",
                self.revoke_token_view,
                "budgeting_serviceclient_revoke_token",
            ),
        ]

    def rotate_view(self, request: HttpRequest, client_id: int) -> HttpResponse:
        require(request, "budgeting.add_apitoken")
        client = self.object_or_404(request, client_id)
        form = RotateForm(request.POST or None, initial={"once": secrets.token_hex(16)})
        if request.method == "POST" and form.is_valid():
            seen: list[str] = request.session.get(ROTATIONS_SEEN, [])
            if form.cleaned_data["once"] in seen:
                messages.warning(
                    request,
                    "That token was issued already and shown once; it is not shown again and no other "
                    "token was issued. Rotate again if it was not copied.",
                )
                return HttpResponseRedirect(change_url(client))
            request.session[ROTATIONS_SEEN] = [*seen, form.cleaned_data["once"]][-20:]
            now = timezone.now()
            issued = tokens.issue_token(
                client_id=client.pk,
                name=form.cleaned_data["name"],
                expires_at=form.cleaned_data["expires_at"],
                retire_current_at=form.retire_current_at(now),
                reason=form.cleaned_data["reason"],
                actor=actor(request),
                now=now,
            )
            shown = admin_page(
                request,
                self,
                "admin/budgeting/serviceclient/token_issued.html",
                {
                    "original": client,
                    "title": f"New token for {client}",
                    "issued": issued,
                    "form_retire_at": form.cleaned_data["retire_at"],
                },
            )
            shown["Cache-Control"] = "no-store"
            return shown
        return confirm_page(
            request,
            self,
            obj=client,
            title=f"Rotate the token of {client}",
            lead="A new token is issued and shown once. Revoke the current tokens now, retire them at a time "
            "you choose (they keep working until then), or leave them active and revoke them later.",
            form=form,
            submit="Issue new token",
            cancel_url=change_url(client),
        )

    def revoke_token_view(self, request: HttpRequest, client_id: int, token_id: int) -> HttpResponse:
        require(request, "budgeting.change_apitoken")
        token = ApiToken.objects.filter(pk=token_id, client_id=client_id).select_related("client").first()
        if token is None:
            raise Http404(f"No token {token_id} of service client {client_id}.")
        form = ReasonForm(request.POST or None)
        if request.method == "POST" and form.is_valid():
            tokens.revoke_token(
                token_id=token.pk,
                reason=form.cleaned_data["reason"],
                actor=actor(request),
                now=timezone.now(),
            )
            messages.success(request, f"Token {token.prefix}… revoked.")
            return HttpResponseRedirect(change_url(token.client))
        return confirm_page(
            request,
            self,
            obj=token.client,
            title=f"Revoke token {token.prefix}…",
            lead="Gateways still using this token will get 401 from their next request.",
            form=form,
            submit="Revoke token",
            cancel_url=change_url(token.client),
            danger=True,
        )


class PriceForm(AuditedForm):
    def clean_effective_from(self) -> datetime:
        value: datetime = self.cleaned_data["effective_from"]
        # "Now" as the form was checked: a start typed as the page's pre-filled now (a minute ago) means now.
        self.checked_at = timezone.now()
        if value < self.checked_at - timedelta(minutes=1):
            raise forms.ValidationError(
                "A price cannot start in the past: it would re-price admissions already made. "
                "A correction is a new price from now on."
            )
        return max(value, self.checked_at)


@admin.register(Price)
class PriceAdmin(AuditedAdmin[Price]):
    """Prices are added, never edited (a correction is a new price from now on): the add form writes
    through ``catalog.prices.add_price``, and a saved price is read-only here (and, once an admission used
    it, in the database)."""

    form = PriceForm
    list_display = [
        "model_revision",
        "effective_from",
        "currency",
        "input_price",
        "output_price",
        "note",
    ]
    list_filter = ["model_revision", "currency"]
    date_hierarchy = "effective_from"

    @admin.display(description="input per 1M tokens", ordering="input_per_million")
    def input_price(self, price: Price) -> str:
        return formats.unit_price(price.input_per_million, price.currency)

    @admin.display(description="output per 1M tokens", ordering="output_per_million")
    def output_price(self, price: Price) -> str:
        return formats.unit_price(price.output_per_million, price.currency)

    fields = [
        "model_revision",
        "effective_from",
        "currency",
        "input_per_million",
        "cached_input_per_million",
        "output_per_million",
        "note",
    ]

    def has_change_permission(self, request: HttpRequest, obj: Price | None = None) -> bool:
        return obj is None and super().has_change_permission(request, obj)

    def get_changeform_initial_data(self, request: HttpRequest) -> dict[str, Any]:
        return {**super().get_changeform_initial_data(request), "effective_from": timezone.now()}

    def save_model(self, request: HttpRequest, obj: Price, form: Any, change: bool) -> None:
        price = add_price(
            model_revision=obj.model_revision,
            currency=obj.currency,
            input_per_million=obj.input_per_million,
            output_per_million=obj.output_per_million,
            cached_input_per_million=obj.cached_input_per_million,
            effective_from=obj.effective_from,
            note=obj.note,
            actor=actor(request),
            reason=form.cleaned_data["change_reason"],
            now=form.checked_at,
        )
        obj.pk = price.pk
        obj.created_at = price.created_at

    def save_related(self, request: HttpRequest, form: Any, formsets: Any, change: bool) -> None:
        """Nothing: ``add_price`` wrote the change-log entry with the price."""
