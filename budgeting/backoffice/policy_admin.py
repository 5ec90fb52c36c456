"""The policies' admin: versions (drafts edited as JSON, validation, comparison) and the alias in force
(activation and rollback by compare-and-swap, each through a confirmation page and one service call)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import ValidationError
from django.db import models
from django.db.models import QuerySet
from django.forms.fields import InvalidJSONInput
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect, JsonResponse
from django.urls import URLPattern, path, reverse
from django.utils import timezone
from django.utils.safestring import SafeString

from budgeting.backoffice.kit import (
    AuditedAdmin,
    AuditedForm,
    ReadOnlyAdmin,
    ReasonForm,
    Row,
    actor,
    admin_page,
    change_url,
    changelist_url,
    confirm_page,
    problem_message,
    recent_changes,
    require,
)
from budgeting.catalog import policies as policy_services
from budgeting.catalog.errors import DomainError
from budgeting.catalog.models import PolicyAlias, PolicyState, PolicyVersion
from budgeting.catalog.policy_schema import schema
from budgeting.catalog.snapshot import ACTIVE_ALIAS


class PrettyJSONField(forms.JSONField):
    """A JSON field shown indented, so a policy document is edited as a readable structure; text that is not
    JSON is refused with the line and column where parsing stopped."""

    def prepare_value(self, value: Any) -> Any:
        if isinstance(value, InvalidJSONInput):
            return value
        return json.dumps(value, indent=2, ensure_ascii=False, cls=self.encoder)

    def to_python(self, value: Any) -> Any:
        try:
            return super().to_python(value)
        except ValidationError:
            try:
                json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValidationError(
                    f"Not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}.", code="invalid"
                ) from None
            raise


def editor_area(*, readonly: bool = False) -> forms.Textarea:
    """The policy document's text area; ``policy/editor.js`` turns it into the schema-aware editor."""
    attrs = {"rows": 30, "cols": 100, "class": "tb-code", "spellcheck": "false", "data-policy-editor": ""}
    return forms.Textarea(attrs={**attrs, "readonly": ""} if readonly else attrs)


class PolicyDraftForm(AuditedForm):
    """A draft's document as JSON; saving refuses a document the policy validator rejects, naming the
    field at fault."""

    document = PrettyJSONField(
        widget=editor_area(),
        help_text="The policy document (JSON). Its revision must equal the version's revision. The editor "
        "completes field names and values from the policy's JSON Schema (Ctrl-Space) and explains a field on "
        "hover; saving reports every error at once.",
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


class AliasMoveForm(ReasonForm):
    expected_version = forms.IntegerField(widget=forms.HiddenInput, required=False)


def _tokens(value: int | None) -> str | None:
    return None if value is None else f"{value:,} tokens"


def _plan_rows(plan: policy_services.AliasPlan) -> list[Row]:
    return [
        ("version", f"r{plan.from_revision}" if plan.from_revision else "—", f"r{plan.to_revision}", False),
        (
            "global input cap per request",
            _tokens(plan.cap_before),
            _tokens(plan.cap_after),
            plan.cap_before is not None and plan.cap_after < plan.cap_before,
        ),
        ("cached token counts", "kept", "cleared" if plan.clears_caches else "kept", plan.clears_caches),
    ]


def alias_move_page(
    request: HttpRequest,
    model_admin: admin.ModelAdmin[Any],
    obj: models.Model,
    *,
    plan: Callable[[], policy_services.AliasPlan],
    move: Callable[[dict[str, Any]], str],
    done_url: str,
    page: Callable[[policy_services.AliasPlan], dict[str, Any]],
) -> HttpResponse:
    """Plan an alias move, show it (``page``: title, lead, submit, ...) and, once confirmed, ``move`` it with
    the form's data: its ``expected_version`` is the version seen on the page, the compare-and-swap's
    expectation (``move`` answers the success message).

    A refused move (someone moved the alias first) is planned again from where the alias is now, so the page
    shows the new situation — or, when the alias already points where this move would take it, says so
    instead of offering a move to where it is.
    """
    form = AliasMoveForm(request.POST or None)
    refused = False
    if request.method == "POST" and form.is_valid():
        try:
            done = move(form.cleaned_data)
        except DomainError as problem:
            problem_message(request, problem)
            refused = True
        else:
            messages.success(request, done)
            return HttpResponseRedirect(done_url)
    try:
        planned = plan()
    except DomainError as problem:
        problem_message(request, problem)
        return HttpResponseRedirect(change_url(obj))
    if refused or request.method != "POST":
        # The compare-and-swap expects the version shown on this page, not the one the refused form saw.
        reason = form.cleaned_data["reason"] if refused else ""
        form = AliasMoveForm(initial={"expected_version": planned.from_version_id, "reason": reason})
    return confirm_page(
        request,
        model_admin,
        obj=obj,
        form=form,
        cancel_url=change_url(obj),
        rows=_plan_rows(planned),
        diff=planned.diff,
        **page(planned),
    )


def schema_view(request: HttpRequest) -> JsonResponse:
    """``GET /admin/budgeting/policyversion/schema.json``: the policy document's JSON Schema, no sign-in."""
    response = JsonResponse(schema(), content_type="application/schema+json", json_dumps_params={"indent": 2})
    response["Cache-Control"] = "public, max-age=300"
    return response


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
        text = json.dumps(obj.document, indent=2, ensure_ascii=False)
        return editor_area(readonly=True).render("document_view", text)

    def changeform_view(
        self,
        request: HttpRequest,
        object_id: str | None = None,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        context = {**(extra_context or {}), "policy_schema": schema()}
        return super().changeform_view(request, object_id, form_url, context)

    def get_urls(self) -> list[URLPattern]:
        # The schema is public, like any published format: editors and CI check files against it.
        return [
            path("schema.json", schema_view, name="budgeting_policyversion_schema"),
            *super().get_urls(),
        ]

    @admin.display(description="active as")
    def active_as(self, obj: PolicyVersion) -> str:
        return ", ".join(PolicyAlias.objects.filter(version=obj).values_list("name", flat=True))

    def get_changeform_initial_data(self, request: HttpRequest) -> dict[str, Any]:
        """A new draft has the next free revision and starts from the active version's document (``?copy_of=
        <id>``: from that version's), or from the document's required fields when there is none yet — never
        from ``null``."""
        revision = (
            PolicyVersion.objects.order_by("-revision").values_list("revision", flat=True).first() or 0
        ) + 1
        source = PolicyVersion.objects.filter(pk=request.GET.get("copy_of") or 0).first()
        if source is None:
            alias = PolicyAlias.objects.filter(name=ACTIVE_ALIAS).select_related("version").first()
            source = alias.version if alias else None
        if source is None:
            return {
                **super().get_changeform_initial_data(request),
                "revision": revision,
                "document": {"revision": revision, "taskClasses": {}},
            }
        return {
            "revision": revision,
            "note": f"copy of r{source.revision}"
            if request.GET.get("copy_of")
            else f"from r{source.revision}",
            "document": {**source.document, "revision": revision},
        }

    def page_context(self, request: HttpRequest, obj: PolicyVersion) -> dict[str, Any]:
        return {
            "active_alias": PolicyAlias.objects.filter(name=ACTIVE_ALIAS).first(),
            "alias_name": ACTIVE_ALIAS,
            "can_validate": request.user.has_perm("budgeting.change_policyversion"),
            "can_activate": request.user.has_perm("budgeting.change_policyalias"),
            "can_copy": request.user.has_perm("budgeting.add_policyversion"),
        }

    @admin.action(description="Compare the two selected versions")
    def compare_versions(
        self, request: HttpRequest, queryset: QuerySet[PolicyVersion]
    ) -> HttpResponse | None:
        ids = sorted(queryset.values_list("revision", flat=True))
        if len(ids) != 2:
            messages.warning(request, "Select exactly two versions to compare.")
            return None
        return HttpResponseRedirect(reverse("admin:budgeting_policyversion_diff") + f"?a={ids[0]}&b={ids[1]}")

    def page_urls(self) -> list[tuple[str, Callable[..., HttpResponse], str]]:
        return [
            ("diff/", self.diff_view, "budgeting_policyversion_diff"),
            ("<int:version_id>/validate/", self.validate_view, "budgeting_policyversion_validate"),
            ("<int:version_id>/activate/", self.activate_view, "budgeting_policyversion_activate"),
        ]

    def diff_view(self, request: HttpRequest) -> HttpResponse:
        """Compare two versions by revision (``?a=18&b=19``)."""
        require(request, "budgeting.view_policyversion")
        versions = list(PolicyVersion.objects.order_by("revision"))
        by_revision = {str(v.revision): v for v in versions}
        a = by_revision.get(request.GET.get("a", ""))
        b = by_revision.get(request.GET.get("b", ""))
        lines = policy_services.diff_documents(a.document, b.document) if a and b else []
        return admin_page(
            request,
            self,
            "admin/budgeting/policyversion/diff.html",
            {"title": "Compare policy versions", "versions": versions, "a": a, "b": b, "lines": lines},
        )

    def validate_view(self, request: HttpRequest, version_id: int) -> HttpResponse:
        require(request, "budgeting.change_policyversion")
        version = self.object_or_404(request, version_id)
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
            except DomainError as problem:
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
        version = self.object_or_404(request, version_id)

        def move(data: dict[str, Any]) -> str:
            plan = policy_services.activate(
                alias_name=ACTIVE_ALIAS,
                version_id=version.pk,
                expected_version_id=data["expected_version"],
                reason=data["reason"],
                actor=actor(request),
            ).plan
            return (
                f"{ACTIVE_ALIAS} → r{plan.to_revision} (was r{plan.from_revision}); "
                f"global cap {plan.cap_before:,} → {plan.cap_after:,} tokens."
            )

        return alias_move_page(
            request,
            self,
            version,
            plan=lambda: policy_services.plan_activation(alias_name=ACTIVE_ALIAS, version_id=version.pk),
            move=move,
            done_url=changelist_url(PolicyAlias),
            page=lambda plan: {
                "title": f"Activate r{plan.to_revision} as {ACTIVE_ALIAS}",
                "lead": f"{ACTIVE_ALIAS} moves from r{plan.from_revision} to r{plan.to_revision} by "
                "compare-and-swap: if someone moves it first, nothing changes and you are asked again. "
                f"r{plan.from_revision} becomes the rollback target.",
                "submit": f"Activate r{plan.to_revision}",
            },
        )


@admin.register(PolicyAlias)
class PolicyAliasAdmin(ReadOnlyAdmin[PolicyAlias]):
    list_display = ["name", "version", "previous", "effective_cap", "global_cap_floor", "updated_at"]
    change_list_template = "admin/tokenbudget/wide_change_list.html"
    fields = ["name", "version", "previous", "effective_cap", "global_cap_floor", "updated_at"]
    change_form_template = "admin/budgeting/policyalias/change_form.html"

    def get_queryset(self, request: HttpRequest) -> QuerySet[PolicyAlias]:
        return super().get_queryset(request).select_related("version", "previous")

    @admin.display(description="global cap in force")
    def effective_cap(self, obj: PolicyAlias) -> str:
        return f"{policy_services.effective_cap(obj):,} tokens"

    def page_context(self, request: HttpRequest, obj: PolicyAlias) -> dict[str, Any]:
        return {
            "can_roll_back": request.user.has_perm("budgeting.change_policyalias"),
            "changes": recent_changes(obj),
            "cap": policy_services.cap_in_force(obj),
        }

    def page_urls(self) -> list[tuple[str, Callable[..., HttpResponse], str]]:
        return [("<int:alias_id>/rollback/", self.rollback_view, "budgeting_policyalias_rollback")]

    def rollback_view(self, request: HttpRequest, alias_id: int) -> HttpResponse:
        require(request, "budgeting.change_policyalias")
        alias = self.object_or_404(request, alias_id)

        def move(data: dict[str, Any]) -> str:
            done = policy_services.rollback(
                alias_name=alias.name,
                expected_version_id=data["expected_version"],
                reason=data["reason"],
                actor=actor(request),
            )
            cleared = (
                f"{done.caches_cleared:,} cached token counts cleared"
                if done.caches_cleared is not None
                else "clearing the token-count cache FAILED (see the logs; counts under the old policy "
                "are still correct, only slower to replace)"
            )
            cap = policy_services.cap_in_force(PolicyAlias.objects.select_related("version").get(pk=alias.pk))
            return (
                f"{alias.name} rolled back to r{done.plan.to_revision} (from r{done.plan.from_revision}); "
                f"{cleared}. Global cap in force: {cap.explain()}"
            )

        return alias_move_page(
            request,
            self,
            alias,
            plan=lambda: policy_services.plan_rollback(alias_name=alias.name),
            move=move,
            done_url=change_url(alias),
            page=lambda plan: {
                "title": f"Roll {alias.name} back to r{plan.to_revision}",
                "lead": f"{alias.name} moves back from r{plan.from_revision} to r{plan.to_revision} by "
                f"compare-and-swap. The lower of the two global caps ({plan.cap_floor_after:,} tokens) is "
                "kept, and every cached token count is cleared after the move.",
                "submit": f"Roll back to r{plan.to_revision}",
                "danger": True,
            },
        )
