"""The admin of the catalog, policies, prices, manifests, reports and the change log.

Catalog objects (tenants, task classes, pools, model revisions, tokenizers, service clients) and prices are
edited with forms that ask for a reason; every save lands in the change log. Everything that moves state
(policy validation, activation, rollback, token rotation) is a button that opens a confirmation page and then
makes one service call. Nothing is ever deleted from the admin.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

from django import forms
from django.conf import settings
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db import models
from django.db.models import QuerySet
from django.forms.fields import InvalidJSONInput
from django.forms.models import ModelForm
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import NoReverseMatch, URLPattern, path, reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from budgeting import admin_services
from budgeting.admin_services import Actor, record_change, snapshot
from budgeting.admission.models import Manifest
from budgeting.admission.replay import replay_manifest
from budgeting.api.problems import Problem
from budgeting.backoffice.models import UsageReport
from budgeting.backoffice.report_views import report_page
from budgeting.catalog.models import (
    ApiToken,
    ChangeRecord,
    ModelPool,
    ModelRevision,
    PolicyAlias,
    PolicyState,
    PolicyVersion,
    Price,
    ServiceClient,
    TaskClass,
    TemporaryIncrease,
    Tenant,
    Tokenizer,
)
from budgeting.catalog.provisioning import CAPABILITIES, TEMPLATE_FAMILIES
from budgeting.catalog.selectors import ACTIVE_ALIAS
from budgeting.catalog import policies as policy_services
from budgeting.catalog.tokenizer_assets import sha256_file
from ladder.counting import upper_bound_rule

admin.site.site_header = "Token budget"
admin.site.site_title = "Token budget admin"
admin.site.index_title = "Operations"

M = TypeVar("M", bound=models.Model)


# --- the shared admin kit (used by the ledger and billing admin pages too) ---------------------------------


class ReasonForm(forms.Form):
    """The reason every privileged change carries into the change log."""

    reason = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 2, "cols": 60}),
        help_text="Recorded in the change log with your name and the time.",
    )


def actor(request: HttpRequest) -> Actor:
    return Actor.of(request.user)


def require(request: HttpRequest, permission: str) -> None:
    """Raise PermissionDenied (403) unless the signed-in user holds ``permission``."""
    if not request.user.has_perm(permission):
        raise PermissionDenied


def confirm_page(
    request: HttpRequest,
    model_admin: admin.ModelAdmin[Any],
    *,
    title: str,
    lead: str,
    form: forms.Form,
    submit: str,
    cancel_url: str,
    rows: Sequence[tuple[str, Any, Any, bool]] = (),
    warnings: Sequence[str] = (),
    diff: Sequence[policy_services.DiffLine] = (),
    hidden_form: bool = False,
    visible: Sequence[str] = (),
    danger: bool = False,
    multipart: bool = False,
    obj: models.Model | None = None,
) -> TemplateResponse:
    """The confirmation page of a state change: what changes (before/after rows, a diff), warnings, and the
    form (with ``hidden_form``, its fields filled on the previous page are hidden, except ``visible``)."""
    return TemplateResponse(
        request,
        "admin/tokenbudget/confirm.html",
        {
            **model_admin.admin_site.each_context(request),
            "opts": model_admin.model._meta,
            "original": obj,
            "title": title,
            "lead": lead,
            "form": form,
            "submit": submit,
            "cancel_url": cancel_url,
            "rows": rows,
            "warnings": warnings,
            "diff": diff,
            "hidden_form": hidden_form,
            "visible": list(visible),
            "danger": danger,
            "multipart": multipart,
        },
    )


def problem_message(request: HttpRequest, problem: Problem) -> None:
    messages.error(request, f"{problem.title}: {problem.detail}")


def change_url(obj: models.Model) -> str:
    return reverse(f"admin:{obj._meta.app_label}_{obj._meta.model_name}_change", args=[obj.pk])


def changelist_url(model: type[models.Model]) -> str:
    return reverse(f"admin:{model._meta.app_label}_{model._meta.model_name}_changelist")


def pretty_json(value: Any) -> SafeString:
    return format_html('<pre class="tb-json">{}</pre>', json.dumps(value, indent=2, ensure_ascii=False))


class ReadOnlyAdmin(admin.ModelAdmin[M]):
    """Records that only services write: viewable, never added, changed or deleted from a form."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: M | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: M | None = None) -> bool:
        return False


class AuditedForm(ModelForm):
    change_reason = forms.CharField(
        label="Reason for this change",
        widget=forms.Textarea(attrs={"rows": 2, "cols": 60}),
        help_text="Recorded in the change log with your name, the time, and the values before and after.",
    )


class AuditedAdmin(admin.ModelAdmin[M]):
    """Form-edited configuration: every add or change asks for a reason and is written to the change log in
    the same transaction (the admin wraps the save in one). Nothing is deleted."""

    form = AuditedForm

    def get_fields(self, request: HttpRequest, obj: M | None = None) -> list[Any]:
        fields = [f for f in super().get_fields(request, obj) if f != "change_reason"]
        editable = self.has_change_permission(request, obj) if obj else self.has_add_permission(request)
        return [*fields, "change_reason"] if editable else fields

    def has_delete_permission(self, request: HttpRequest, obj: M | None = None) -> bool:
        return False

    def save_model(self, request: HttpRequest, obj: M, form: Any, change: bool) -> None:
        stored = type(obj)._default_manager.filter(pk=obj.pk).first() if change else None
        form.audit_before = snapshot(stored) if stored is not None else None
        super().save_model(request, obj, form, change)

    def save_related(self, request: HttpRequest, form: Any, formsets: Any, change: bool) -> None:
        super().save_related(request, form, formsets, change)
        obj = form.instance
        record_change(
            actor=actor(request),
            action=f"{obj._meta.model_name}.{'change' if change else 'add'}",
            target=obj,
            before=form.audit_before,
            after=snapshot(obj),
            reason=form.cleaned_data["change_reason"],
        )


# --- catalog ------------------------------------------------------------------------------------------------


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
        "input_cap",
        "max_output_cap",
        "queue_allowed",
        "queue_deadline_seconds",
        "ramp_percent",
    ]
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


@admin.register(ModelPool)
class ModelPoolAdmin(AuditedAdmin[ModelPool]):
    list_display = ["slug", "region", "provider_base_url"]
    search_fields = ["slug", "region"]
    fields = ["slug", "region", "provider_base_url"]


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
        try:
            rule = upper_bound_rule(json.loads(file.read_bytes()))
        except ValueError:
            raise forms.ValidationError(f"{name} is not a tokenizer JSON file") from None
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
        "context_window",
        "max_output",
        "template_family",
        "data_residency",
        "safety_tier",
        "pool_list",
    ]
    list_filter = ["template_family", "data_residency", "pools"]
    search_fields = ["name"]
    filter_horizontal = ["pools"]

    def get_queryset(self, request: HttpRequest) -> QuerySet[ModelRevision]:
        return super().get_queryset(request).select_related("tokenizer").prefetch_related("pools")

    @admin.display(description="pools")
    def pool_list(self, obj: ModelRevision) -> str:
        return ", ".join(p.slug for p in obj.pools.all())


class ApiTokenInline(admin.TabularInline[ApiToken, ServiceClient]):
    model = ApiToken
    extra = 0
    can_delete = False
    fields = ("prefix", "created_at", "revoked_at", "revoke")
    readonly_fields = ("prefix", "created_at", "revoked_at", "revoke")

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    @admin.display(description="")
    def revoke(self, token: ApiToken) -> str:
        if token.revoked_at is not None:
            return "revoked"
        url = reverse("admin:budgeting_serviceclient_revoke_token", args=[token.client_id, token.pk])
        return format_html('<a class="button" href="{}">Revoke…</a>', url)


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

    def get_urls(self) -> list[URLPattern]:
        wrap = self.admin_site.admin_view
        return [
            path("<int:client_id>/rotate/", wrap(self.rotate_view), name="budgeting_serviceclient_rotate"),
            path(
                "<int:client_id>/tokens/<int:token_id>/revoke/",
                wrap(self.revoke_token_view),
                name="budgeting_serviceclient_revoke_token",
            ),
            *super().get_urls(),
        ]

    def rotate_view(self, request: HttpRequest, client_id: int) -> HttpResponse:
        require(request, "budgeting.add_apitoken")
        client = self.get_object(request, str(client_id))
        if client is None:
            raise PermissionDenied
        form = RotateForm(request.POST or None)
        if request.method == "POST" and form.is_valid():
            issued = admin_services.rotate_token(
                client_id=client.pk,
                revoke_current=form.cleaned_data["revoke_current"],
                reason=form.cleaned_data["reason"],
                actor=actor(request),
                now=timezone.now(),
            )
            return TemplateResponse(
                request,
                "admin/budgeting/serviceclient/token_issued.html",
                {
                    **self.admin_site.each_context(request),
                    "opts": self.model._meta,
                    "original": client,
                    "title": f"New token for {client}",
                    "issued": issued,
                },
            )
        return confirm_page(
            request,
            self,
            obj=client,
            title=f"Rotate the token of {client}",
            lead="A new token is issued and shown once. Revoke the current tokens now, or leave them active "
            "until the gateways have switched and revoke them then.",
            form=form,
            submit="Issue new token",
            cancel_url=change_url(client),
        )

    def revoke_token_view(self, request: HttpRequest, client_id: int, token_id: int) -> HttpResponse:
        require(request, "budgeting.change_apitoken")
        token = ApiToken.objects.filter(pk=token_id, client_id=client_id).select_related("client").first()
        if token is None:
            raise PermissionDenied
        form = ReasonForm(request.POST or None)
        if request.method == "POST" and form.is_valid():
            admin_services.revoke_token(
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


class RotateForm(ReasonForm):
    revoke_current = forms.BooleanField(
        required=False, initial=False, label="Revoke the client's current tokens now"
    )


# --- prices -------------------------------------------------------------------------------------------------


@admin.register(Price)
class PriceAdmin(AuditedAdmin[Price]):
    list_display = [
        "model_revision",
        "effective_from",
        "currency",
        "input_per_million",
        "output_per_million",
        "note",
    ]
    list_filter = ["model_revision", "currency"]
    date_hierarchy = "effective_from"
    fields = [
        "model_revision",
        "effective_from",
        "currency",
        "input_per_million",
        "output_per_million",
        "note",
    ]


@admin.register(TemporaryIncrease)
class TemporaryIncreaseAdmin(ReadOnlyAdmin[TemporaryIncrease]):
    """Granted from an account's page; here they are listed, revoked early, or ended when due."""

    list_display = [
        "account_link",
        "input_tokens",
        "output_tokens",
        "concurrency",
        "starts_at",
        "expires_at",
        "status",
        "created_by",
        "reason",
    ]
    list_filter = [("ended_at", admin.EmptyFieldListFilter), "expires_at"]
    search_fields = ["reason", "created_by", "account__tenant__slug", "account__pool__slug"]
    actions = ["revoke", "end_expired"]
    list_select_related = ["account__tenant", "account__task_class", "account__pool"]

    @admin.display(description="account")
    def account_link(self, obj: TemporaryIncrease) -> str:
        return format_html('<a href="{}">{}</a>', change_url(obj.account), obj.account)

    @admin.display(description="status")
    def status(self, obj: TemporaryIncrease) -> str:
        if obj.ended_at is None:
            return "active" if obj.expires_at > timezone.now() else "due to end"
        return f"ended {obj.ended_at:%Y-%m-%d %H:%M} ({obj.end_reason})"

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
                admin_services.end_temporary_increase(
                    increase_id=i.pk,
                    reason=f"revoked: {form.cleaned_data['reason']}",
                    actor=actor(request),
                    now=now,
                )
                for i in active
            )
            messages.success(request, f"{ended} temporary increase(s) revoked; their limits are taken back.")
            return None
        return TemplateResponse(
            request,
            "admin/tokenbudget/action_confirm.html",
            {
                **self.admin_site.each_context(request),
                "opts": self.model._meta,
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
        ended = admin_services.expire_temporary_increases(now=timezone.now())
        messages.success(request, f"{ended} expired increase(s) ended.")


# --- policies -----------------------------------------------------------------------------------------------


class PrettyJSONField(forms.JSONField):
    """A JSON field shown indented, so a policy document is edited as a readable structure."""

    def prepare_value(self, value: Any) -> Any:
        if isinstance(value, InvalidJSONInput):
            return value
        return json.dumps(value, indent=2, ensure_ascii=False, cls=self.encoder)


class PolicyDraftForm(AuditedForm):
    """A draft's document as JSON; saving refuses a document the policy validator rejects, naming the
    field at fault."""

    document = PrettyJSONField(
        widget=forms.Textarea(attrs={"rows": 30, "cols": 100, "class": "tb-code", "spellcheck": "false"}),
        help_text="The policy document (JSON). Its revision must equal the version's revision.",
    )

    class Meta:
        model = PolicyVersion
        fields = ["revision", "note", "document"]

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        if "document" in data and "revision" in data:
            for error in policy_services.document_errors(data["document"], revision=data["revision"]):
                self.add_error("document", f"{error.path}: {error.message}")
        return data


@admin.register(PolicyVersion)
class PolicyVersionAdmin(AuditedAdmin[PolicyVersion]):
    form = PolicyDraftForm
    list_display = ["revision", "state", "active_as", "note", "created_at", "validated_at"]
    list_filter = ["state"]
    search_fields = ["note", "revision"]
    readonly_fields = ["state", "created_at", "validated_at"]
    actions = ["compare_versions"]
    change_form_template = "admin/budgeting/policyversion/change_form.html"

    def has_change_permission(self, request: HttpRequest, obj: PolicyVersion | None = None) -> bool:
        # A validated version is immutable (a trigger enforces it too): its page is view-only.
        return super().has_change_permission(request, obj) and (obj is None or obj.state == PolicyState.DRAFT)

    def get_readonly_fields(self, request: HttpRequest, obj: PolicyVersion | None = None) -> list[str]:
        if obj is not None and not self.has_change_permission(request, obj):
            return ["revision", "state", "note", "document_view", "created_at", "validated_at"]
        return list(self.readonly_fields)

    def get_fields(self, request: HttpRequest, obj: PolicyVersion | None = None) -> list[Any]:
        if obj is not None and not self.has_change_permission(request, obj):
            return ["revision", "state", "note", "document_view", "created_at", "validated_at"]
        return list(super().get_fields(request, obj))

    @admin.display(description="document")
    def document_view(self, obj: PolicyVersion) -> SafeString:
        return pretty_json(obj.document)

    @admin.display(description="active as")
    def active_as(self, obj: PolicyVersion) -> str:
        return ", ".join(PolicyAlias.objects.filter(version=obj).values_list("name", flat=True))

    def get_changeform_initial_data(self, request: HttpRequest) -> dict[str, Any]:
        """``?copy_of=<id>``: start a new draft from an existing version, with the next free revision."""
        source = PolicyVersion.objects.filter(pk=request.GET.get("copy_of") or 0).first()
        if source is None:
            return super().get_changeform_initial_data(request)
        revision = (
            PolicyVersion.objects.order_by("-revision").values_list("revision", flat=True).first() or 0
        ) + 1
        return {
            "revision": revision,
            "note": f"copy of r{source.revision}",
            "document": {**source.document, "revision": revision},
        }

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        alias = PolicyAlias.objects.filter(name=ACTIVE_ALIAS).first()
        context = {
            **(extra_context or {}),
            "active_alias": alias,
            "alias_name": ACTIVE_ALIAS,
            "can_validate": request.user.has_perm("budgeting.change_policyversion"),
            "can_activate": request.user.has_perm("budgeting.change_policyalias"),
            "can_copy": request.user.has_perm("budgeting.add_policyversion"),
        }
        return super().change_view(request, object_id, form_url, context)

    @admin.action(description="Compare the two selected versions")
    def compare_versions(
        self, request: HttpRequest, queryset: QuerySet[PolicyVersion]
    ) -> HttpResponse | None:
        ids = sorted(queryset.values_list("revision", flat=True))
        if len(ids) != 2:
            messages.warning(request, "Select exactly two versions to compare.")
            return None
        return HttpResponseRedirect(reverse("admin:budgeting_policyversion_diff") + f"?a={ids[0]}&b={ids[1]}")

    def get_urls(self) -> list[URLPattern]:
        wrap = self.admin_site.admin_view
        return [
            path("diff/", wrap(self.diff_view), name="budgeting_policyversion_diff"),
            path(
                "<int:version_id>/validate/",
                wrap(self.validate_view),
                name="budgeting_policyversion_validate",
            ),
            path(
                "<int:version_id>/activate/",
                wrap(self.activate_view),
                name="budgeting_policyversion_activate",
            ),
            *super().get_urls(),
        ]

    def diff_view(self, request: HttpRequest) -> HttpResponse:
        """Compare two versions by revision (``?a=18&b=19``)."""
        require(request, "budgeting.view_policyversion")
        versions = list(PolicyVersion.objects.order_by("revision"))
        by_revision = {str(v.revision): v for v in versions}
        a = by_revision.get(request.GET.get("a", ""))
        b = by_revision.get(request.GET.get("b", ""))
        lines = policy_services.diff_documents(a.document, b.document) if a and b else []
        return TemplateResponse(
            request,
            "admin/budgeting/policyversion/diff.html",
            {
                **self.admin_site.each_context(request),
                "opts": self.model._meta,
                "title": "Compare policy versions",
                "versions": versions,
                "a": a,
                "b": b,
                "lines": lines,
            },
        )

    def _version(self, request: HttpRequest, version_id: int) -> PolicyVersion:
        version = self.get_object(request, str(version_id))
        if version is None:
            raise PermissionDenied
        return version

    def validate_view(self, request: HttpRequest, version_id: int) -> HttpResponse:
        require(request, "budgeting.change_policyversion")
        version = self._version(request, version_id)
        form = ReasonForm(request.POST or None, initial={"reason": "reviewed"})
        errors = policy_services.document_errors(version.document, revision=version.revision)
        if request.method == "POST" and form.is_valid() and not errors:
            try:
                policy_services.validate_version(
                    version_id=version.pk,
                    reason=form.cleaned_data["reason"],
                    actor=actor(request),
                    now=timezone.now(),
                )
            except Problem as problem:
                problem_message(request, problem)
            else:
                messages.success(request, f"r{version.revision} is validated and can no longer change.")
            return HttpResponseRedirect(change_url(version))
        return confirm_page(
            request,
            self,
            obj=version,
            title=f"Validate policy r{version.revision}",
            lead="A validated version is immutable: it can be activated, and never edited again.",
            form=form,
            submit="Validate and freeze",
            cancel_url=change_url(version),
            warnings=[f"{e.path}: {e.message}" for e in errors],
        )

    def activate_view(self, request: HttpRequest, version_id: int) -> HttpResponse:
        require(request, "budgeting.change_policyalias")
        version = self._version(request, version_id)
        try:
            plan = policy_services.plan_activation(alias_name=ACTIVE_ALIAS, version_id=version.pk)
        except Problem as problem:
            problem_message(request, problem)
            return HttpResponseRedirect(change_url(version))
        form = AliasMoveForm(request.POST or None, initial={"expected_version": plan.from_version_id})
        if request.method == "POST" and form.is_valid():
            try:
                policy_services.activate(
                    alias_name=ACTIVE_ALIAS,
                    version_id=version.pk,
                    expected_version_id=form.cleaned_data["expected_version"],
                    reason=form.cleaned_data["reason"],
                    actor=actor(request),
                )
            except Problem as problem:
                problem_message(request, problem)
            else:
                messages.success(
                    request,
                    f"{ACTIVE_ALIAS} → r{plan.to_revision} (was r{plan.from_revision}); "
                    f"global cap {plan.cap_before} → {plan.cap_after}.",
                )
                return HttpResponseRedirect(changelist_url(PolicyAlias))
        return confirm_page(
            request,
            self,
            obj=version,
            title=f"Activate r{plan.to_revision} as {ACTIVE_ALIAS}",
            lead=f"{ACTIVE_ALIAS} moves from r{plan.from_revision} to r{plan.to_revision} by "
            "compare-and-swap: if someone moves it first, nothing changes and you are asked again. "
            f"r{plan.from_revision} becomes the rollback target.",
            form=form,
            submit=f"Activate r{plan.to_revision}",
            cancel_url=change_url(version),
            rows=_plan_rows(plan),
            diff=plan.diff,
        )


def _plan_rows(plan: policy_services.AliasPlan) -> list[tuple[str, Any, Any, bool]]:
    return [
        ("version", f"r{plan.from_revision}" if plan.from_revision else "—", f"r{plan.to_revision}", False),
        (
            "global input cap per request",
            plan.cap_before,
            plan.cap_after,
            plan.cap_before is not None and plan.cap_after < plan.cap_before,
        ),
        ("cached token counts", "kept", "cleared" if plan.clears_caches else "kept", plan.clears_caches),
    ]


class AliasMoveForm(ReasonForm):
    expected_version = forms.IntegerField(widget=forms.HiddenInput, required=False)


@admin.register(PolicyAlias)
class PolicyAliasAdmin(ReadOnlyAdmin[PolicyAlias]):
    list_display = ["name", "version", "previous", "effective_cap", "global_cap_floor", "updated_at"]
    fields = ["name", "version", "previous", "effective_cap", "global_cap_floor", "updated_at"]
    change_form_template = "admin/budgeting/policyalias/change_form.html"

    def get_queryset(self, request: HttpRequest) -> QuerySet[PolicyAlias]:
        return super().get_queryset(request).select_related("version", "previous")

    @admin.display(description="global cap in force")
    def effective_cap(self, obj: PolicyAlias) -> int:
        return policy_services.effective_cap(obj)

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        alias = self.get_object(request, object_id)
        context = {
            **(extra_context or {}),
            "can_roll_back": request.user.has_perm("budgeting.change_policyalias"),
            "changes": recent_changes(alias) if alias is not None else [],
        }
        return super().change_view(request, object_id, form_url, context)

    def get_urls(self) -> list[URLPattern]:
        wrap = self.admin_site.admin_view
        return [
            path("<int:alias_id>/rollback/", wrap(self.rollback_view), name="budgeting_policyalias_rollback"),
            *super().get_urls(),
        ]

    def rollback_view(self, request: HttpRequest, alias_id: int) -> HttpResponse:
        require(request, "budgeting.change_policyalias")
        alias = self.get_object(request, str(alias_id))
        if alias is None:
            raise PermissionDenied
        try:
            plan = policy_services.plan_rollback(alias_name=alias.name)
        except Problem as problem:
            problem_message(request, problem)
            return HttpResponseRedirect(change_url(alias))
        form = AliasMoveForm(request.POST or None, initial={"expected_version": plan.from_version_id})
        if request.method == "POST" and form.is_valid():
            try:
                done = policy_services.rollback(
                    alias_name=alias.name,
                    expected_version_id=form.cleaned_data["expected_version"],
                    reason=form.cleaned_data["reason"],
                    actor=actor(request),
                )
            except Problem as problem:
                problem_message(request, problem)
            else:
                cleared = (
                    f"{done.caches_cleared} cached token counts cleared"
                    if done.caches_cleared is not None
                    else "clearing the token-count cache FAILED (see the logs; counts under the old policy "
                    "are still correct, only slower to replace)"
                )
                messages.success(
                    request,
                    f"{alias.name} rolled back to r{plan.to_revision} (from r{plan.from_revision}); "
                    f"global cap kept at {plan.cap_floor_after}; {cleared}.",
                )
                return HttpResponseRedirect(change_url(alias))
        return confirm_page(
            request,
            self,
            obj=alias,
            title=f"Roll {alias.name} back to r{plan.to_revision}",
            lead=f"{alias.name} moves back from r{plan.from_revision} to r{plan.to_revision} by "
            f"compare-and-swap. The lower of the two global caps ({plan.cap_floor_after}) is kept, and every "
            "cached token count is cleared after the move.",
            form=form,
            submit=f"Roll back to r{plan.to_revision}",
            cancel_url=change_url(alias),
            rows=_plan_rows(plan),
            diff=plan.diff,
            danger=True,
        )


# --- manifests and replay -----------------------------------------------------------------------------------


@admin.register(Manifest)
class ManifestAdmin(ReadOnlyAdmin[Manifest]):
    list_display = [
        "created_at",
        "request_id",
        "tenant",
        "task_class",
        "model_revision",
        "decision",
        "rung",
        "mode",
        "input_tokens",
        "count_method",
    ]
    list_filter = ["decision", "rung", "mode", "tenant", "task_class", "model_pool", "created_at"]
    search_fields = ["request_id", "rendered_digest"]
    date_hierarchy = "created_at"
    change_form_template = "admin/budgeting/manifest/change_form.html"
    fields = [
        "request_id",
        "tenant",
        "task_class",
        "model_pool",
        "model_revision",
        "tokenizer_digest",
        "policy_revision",
        "decision",
        "rung",
        "mode",
        "input_tokens",
        "count_method",
        "rendered_digest",
        "created_at",
    ]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Manifest]:
        return (
            super()
            .get_queryset(request)
            .select_related("tenant", "task_class", "model_pool", "model_revision")
        )

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        manifest = self.get_object(request, object_id)
        context = dict(extra_context or {})
        if manifest is not None:
            context.update(manifest_context(manifest))
        return super().change_view(request, object_id, form_url, context)

    def get_urls(self) -> list[URLPattern]:
        wrap = self.admin_site.admin_view
        return [
            path("<int:manifest_id>/replay/", wrap(self.replay_view), name="budgeting_manifest_replay"),
            *super().get_urls(),
        ]

    def replay_view(self, request: HttpRequest, manifest_id: int) -> HttpResponse:
        """Re-run the decision from the manifest and show whether it matches the record (read-only)."""
        require(request, "budgeting.view_manifest")
        manifest = self.get_object(request, str(manifest_id))
        if manifest is None:
            raise PermissionDenied
        result = replay_manifest(manifest.pk)
        return TemplateResponse(
            request,
            "admin/budgeting/manifest/replay.html",
            {
                **self.admin_site.each_context(request),
                "opts": self.model._meta,
                "original": manifest,
                "title": f"Replay of {manifest.request_id}",
                "result": result,
            },
        )


def manifest_context(manifest: Manifest) -> dict[str, Any]:
    """The manifest's record in the shape the templates show: locked revisions, components (hard buckets
    flagged when their digest changed), ladder steps, removed and excluded objects."""
    record = manifest.record or {}
    components = []
    for name, item in sorted((record.get("components") or {}).items()):
        components.append(
            {
                "name": name,
                "tokens": item.get("tokens"),
                "before": item.get("digestBefore") or "",
                "after": item.get("digestAfter") or "",
                "changed": item.get("digestBefore") != item.get("digestAfter"),
            }
        )
    return {
        "manifest": manifest,
        "locked": sorted((record.get("lockedRevisions") or {}).items()),
        "components": components,
        "steps": record.get("steps") or [],
        "removed": record.get("removed") or [],
        "excluded": record.get("excluded") or [],
        "hard_bucket_changes": record.get("hardBucketChanges", 0),
        "rungs_tried": record.get("rungsTried") or [],
        "record_json": json.dumps(record, indent=2, ensure_ascii=False),
    }


# --- reports and the change log -----------------------------------------------------------------------------


@admin.register(UsageReport)
class UsageReportAdmin(ReadOnlyAdmin[UsageReport]):
    """The report page lives at this model's changelist URL: it has no rows of its own."""

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return request.user.has_perm("budgeting.view_usagereport")

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        context = {**self.admin_site.each_context(request), "opts": self.model._meta, **(extra_context or {})}
        return report_page(request, context)

    def get_urls(self) -> list[URLPattern]:
        wrap = self.admin_site.admin_view
        return [path("", wrap(self.changelist_view), name="budgeting_usagereport_changelist")]


@admin.register(ChangeRecord)
class ChangeRecordAdmin(ReadOnlyAdmin[ChangeRecord]):
    list_display = ["at", "actor_username", "action", "target", "short_reason"]
    list_filter = ["action", "actor_username", "target_type"]
    search_fields = ["target_repr", "reason", "actor_username", "target_id"]
    date_hierarchy = "at"
    fields = ["at", "actor_username", "action", "target", "reason", "changes"]

    @admin.display(description="target")
    def target(self, obj: ChangeRecord) -> str:
        app_label, _, model_name = obj.target_type.partition(".")
        try:
            url = reverse(f"admin:{app_label}_{model_name}_change", args=[obj.target_id])
        except NoReverseMatch:  # a model without an admin page: show the name only
            return obj.target_repr
        return format_html('<a href="{}">{}</a>', url, obj.target_repr)

    @admin.display(description="reason")
    def short_reason(self, obj: ChangeRecord) -> str:
        return obj.reason if len(obj.reason) <= 80 else obj.reason[:79] + "…"

    @admin.display(description="before → after")
    def changes(self, obj: ChangeRecord) -> SafeString:
        return change_table(obj.before, obj.after)


def change_table(before: dict[str, Any] | None, after: dict[str, Any] | None) -> SafeString:
    """A before/after table of the keys that differ (all keys when one side is missing)."""
    before, after = before or {}, after or {}
    keys = sorted(set(before) | set(after))
    changed = [k for k in keys if before.get(k) != after.get(k)] or keys
    rows = format_html_join(
        "",
        "<tr><th>{}</th><td>{}</td><td>{}</td></tr>",
        ((k, json.dumps(before.get(k)), json.dumps(after.get(k))) for k in changed),
    )
    return format_html(
        '<table class="tb-table"><thead><tr><th>field</th><th>before</th><th>after</th></tr></thead>'
        "<tbody>{}</tbody></table>",
        rows,
    )


def recent_changes(obj: models.Model, limit: int = 20) -> QuerySet[ChangeRecord]:
    return ChangeRecord.objects.filter(target_type=obj._meta.label_lower, target_id=str(obj.pk))[:limit]
