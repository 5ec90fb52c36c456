"""The admin kit every back-office page is built from: read-only and audited admins, pages of their own, the
reason form, and the confirmation page that stands between a button and the one service call it makes.

Nothing is ever deleted from the admin: records that services write are read-only, configuration edited with a
form asks for a reason and lands in the change log, and everything that moves state is a button that opens a
confirmation page.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar
from uuid import UUID

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import NON_FIELD_ERRORS, PermissionDenied, ValidationError
from django.db import models
from django.db.models import Q, QuerySet
from django.forms.models import ModelForm
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html
from django.utils.safestring import SafeString

from budgeting.backoffice.formats import count
from budgeting.catalog import policies as policy_services
from budgeting.catalog.changes import Actor, record_change, snapshot
from budgeting.catalog.errors import DomainError
from budgeting.catalog.models import ChangeRecord

admin.site.site_header = "Token budget"
admin.site.site_title = "Token budget admin"
admin.site.index_title = "Operations"
# There is no public site to view: the admin is the product's only page.
admin.site.site_url = None

M = TypeVar("M", bound=models.Model)

# A before/after row of a confirmation page: label, value now, value after, whether to flag it.
Row = tuple[str, Any, Any, bool]


class ReasonForm(forms.Form):
    """The reason every privileged change carries into the change log."""

    reason = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 2, "cols": 60}),
        help_text="Recorded in the change log with your name and the time.",
    )


class StepForm(ReasonForm):
    """A form shown twice: to edit (step=edit) and, with its fields hidden, to confirm (step=confirm)."""

    step = forms.ChoiceField(choices=[("edit", "edit"), ("confirm", "confirm")], widget=forms.HiddenInput)


def actor(request: HttpRequest) -> Actor:
    return Actor.of(request.user)


def require(request: HttpRequest, permission: str) -> None:
    """Raise PermissionDenied (403) unless the signed-in user holds ``permission``."""
    if not request.user.has_perm(permission):
        raise PermissionDenied


def problem_message(request: HttpRequest, problem: DomainError) -> None:
    messages.error(request, f"{problem.title}: {problem.detail}")


def change_url(obj: models.Model) -> str:
    return reverse(f"admin:{obj._meta.app_label}_{obj._meta.model_name}_change", args=[obj.pk])


def changelist_url(model: type[models.Model]) -> str:
    return reverse(f"admin:{model._meta.app_label}_{model._meta.model_name}_changelist")


def link(url: str, text: object) -> SafeString:
    return format_html('<a href="{}">{}</a>', url, text)


def figure_column(
    field: str, title: str, show: Callable[[Any], str] = count, *, ordering: str | None = None
) -> Callable[[Any, Any], SafeString]:
    """A list column showing a number of the row (a field or an annotation) as people read it (``show``:
    ``formats.count`` by default, or ``signed``), right-aligned, sortable by it."""

    def column(model_admin: Any, obj: Any) -> SafeString:
        return format_html('<div class="tb-num">{}</div>', show(getattr(obj, field)))

    return admin.display(description=title, ordering=ordering or field)(column)


def recent_changes(obj: models.Model, limit: int = 20) -> QuerySet[ChangeRecord]:
    return ChangeRecord.objects.filter(target_type=obj._meta.label_lower, target_id=str(obj.pk))[:limit]


def admin_context(request: HttpRequest, model_admin: admin.ModelAdmin[Any]) -> dict[str, Any]:
    """What every admin page's template needs: the site's context and the model's options."""
    return {**model_admin.admin_site.each_context(request), "opts": model_admin.model._meta}


def admin_page(
    request: HttpRequest, model_admin: admin.ModelAdmin[Any], template: str, context: dict[str, Any]
) -> TemplateResponse:
    """A page of the admin site of its own (not a changelist or change form)."""
    return TemplateResponse(request, template, {**admin_context(request, model_admin), **context})


def confirm_page(
    request: HttpRequest,
    model_admin: admin.ModelAdmin[Any],
    *,
    title: str,
    lead: str,
    form: forms.Form,
    submit: str,
    cancel_url: str,
    rows: Sequence[Row] = (),
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
    return admin_page(
        request,
        model_admin,
        "admin/tokenbudget/confirm.html",
        {
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


def two_step_page(
    request: HttpRequest,
    model_admin: admin.ModelAdmin[Any],
    obj: models.Model,
    form_class: type[StepForm],
    *,
    title: str,
    lead: str,
    submit: str,
    preview: Callable[[dict[str, Any]], tuple[list[Row], list[str]]],
    apply: Callable[[dict[str, Any]], str],
    initial: dict[str, Any],
    edit_context: dict[str, Any],
    needs_acknowledgement: Callable[[dict[str, Any]], bool] = lambda data: False,
) -> HttpResponse:
    """Form, then confirmation page (what changes, warnings), then the service call ``apply`` (its answer is
    the success message). A change that ``needs_acknowledgement`` is applied only with the box ticked."""
    form = form_class(request.POST or None, initial=initial)
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        rows, warnings = preview(data)
        acknowledged = not needs_acknowledgement(data) or data.get("acknowledge")
        if data["step"] == "confirm" and acknowledged:
            try:
                done = apply(data)
            except DomainError as problem:
                problem_message(request, problem)
                return HttpResponseRedirect(request.path)
            messages.success(request, done)
            return HttpResponseRedirect(change_url(obj))
        confirm = form_class(initial={**data, "step": "confirm"})
        if data["step"] == "confirm" and not acknowledged:
            warnings = [*warnings, "Tick the box to confirm you mean to go below current use."]
        return confirm_page(
            request,
            model_admin,
            obj=obj,
            title=title,
            lead=lead,
            form=confirm,
            submit=submit,
            cancel_url=change_url(obj),
            rows=rows,
            warnings=warnings,
            hidden_form=True,
            visible=["acknowledge"] if needs_acknowledgement(data) else [],
            danger=bool(warnings),
        )
    return admin_page(
        request,
        model_admin,
        "admin/tokenbudget/edit.html",
        {
            "original": obj,
            "title": title,
            "lead": lead,
            "form": form,
            "cancel_url": change_url(obj),
            **edit_context,
        },
    )


def readable_count(field: models.Field[Any, Any]) -> Callable[[Any], str]:
    """A read-only display of an integer field as people read it ("32,768"; Django would write "32768")."""

    def show(obj: Any) -> str:
        return count(getattr(obj, field.attname))

    show.__name__ = field.name
    return admin.display(description=field.verbose_name)(show)


class KitAdmin(admin.ModelAdmin[M]):
    """An admin whose change page can show more than its form (``page_context``) and which can have pages of
    its own (``page_urls``: route, view, URL name; the views are wrapped by the admin site). Whoever may only
    view a record reads its counts with separators."""

    def get_fields(self, request: HttpRequest, obj: M | None = None) -> list[Any]:
        fields = list(super().get_fields(request, obj))
        if obj is None or self.has_change_permission(request, obj):
            return fields
        integers = {
            f.name: f
            for f in self.model._meta.concrete_fields
            if isinstance(f, models.IntegerField) and not f.primary_key and not f.choices
        }
        return [readable_count(integers[f]) if isinstance(f, str) and f in integers else f for f in fields]

    def page_context(self, request: HttpRequest, obj: M) -> dict[str, Any]:
        return {}

    def page_urls(self) -> list[tuple[str, Callable[..., HttpResponse], str]]:
        return []

    def render_change_form(
        self,
        request: HttpRequest,
        context: dict[str, Any],
        add: bool = False,
        change: bool = False,
        form_url: str = "",
        obj: M | None = None,
    ) -> HttpResponse:
        if change and obj is not None:
            context.update(self.page_context(request, obj))
        return super().render_change_form(request, context, add, change, form_url, obj)

    def get_urls(self) -> list[URLPattern]:
        wrap = self.admin_site.admin_view
        return [
            *(path(route, wrap(view), name=name) for route, view, name in self.page_urls()),
            *super().get_urls(),
        ]

    def object_or_404(self, request: HttpRequest, object_id: int | UUID) -> M:
        """The object a page of this admin is about: 404 when it does not exist (to anyone who may use the
        page: the caller checks the page's permission first), 403 when the user may not see it."""
        obj = self.get_object(request, str(object_id))
        if obj is None:
            raise Http404(f"No {self.model._meta.verbose_name} {object_id}.")
        if not self.has_view_permission(request, obj):
            raise PermissionDenied
        return obj


class ReadOnly:
    """Records that only services write: viewable, never added, changed or deleted from a form."""

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class ReadOnlyAdmin(ReadOnly, KitAdmin[M]):
    """A read-only admin (see ``ReadOnly``)."""


# What the database's check constraints mean, for the people who break them in a form: Django reports a
# violated CheckConstraint by its name ("Constraint “price_currency_iso” is violated.") and on no field, so
# AuditedForm puts these words on the field the rule is about instead.
CONSTRAINT_WORDS: dict[str, tuple[str, str]] = {
    "price_currency_iso": ("currency", "Currency must be a three-letter ISO code, e.g. USD."),
    "price_non_negative": ("input_per_million", "Prices cannot be negative."),
    "taskclass_input_cap_positive": ("input_cap", "The input cap must be at least 1 token."),
    "taskclass_output_cap_positive": ("max_output_cap", "The output cap must be at least 1 token."),
    "taskclass_ramp_percent_le_100": ("ramp_percent", "The ramp is a share of traffic: at most 100 (%)."),
    "modelpool_adapter_of_its_provider": (
        "adapter",
        "This adapter does not belong to the pool's provider: choose one of that provider's adapters.",
    ),
    "tokenizer_digest_format": ("digest", "The digest must be sha256: followed by 64 hexadecimal digits."),
    "modelrevision_window_positive": ("context_window", "The context window must be at least 1 token."),
    "modelrevision_max_output_positive": ("max_output", "The maximum output must be at least 1 token."),
    "alert_thresholds_ordered": (
        "critical_percent",
        "The critical threshold must be above the warning one (warning at least 1 %, critical at most "
        "1000 %).",
    ),
    "modelrevision_output_below_window": (
        "max_output",
        "The maximum output must be smaller than the context window.",
    ),
}
UNNAMED_RULE = "This value breaks a rule of the catalog; check it against the field's help text."


def constraint_fields(constraint: models.BaseConstraint) -> list[str]:
    """The model fields a check constraint's condition names (``max_output__lt`` names ``max_output``)."""
    names: list[str] = []
    pending: list[Any] = [getattr(constraint, "condition", None)]
    while pending:
        node = pending.pop(0)
        if isinstance(node, Q):
            pending.extend(node.children)
        elif isinstance(node, tuple):
            names.append(str(node[0]).split("__")[0])
    return list(dict.fromkeys(names))


class AuditedForm(ModelForm):
    change_reason = forms.CharField(
        label="Reason for this change",
        widget=forms.Textarea(attrs={"rows": 2, "cols": 60}),
        help_text="Recorded in the change log with your name, the time, and the values before and after.",
    )

    def _update_errors(self, errors: ValidationError) -> None:
        # The one place ModelForm takes the model's validation errors in (not in django-stubs, hence the
        # ignore); constraint names become words here.
        super()._update_errors(self._in_words(errors))  # type: ignore[misc]

    def _in_words(self, errors: ValidationError) -> ValidationError:
        """``errors`` with every check-constraint violation moved to its field, in words."""
        if not hasattr(errors, "error_dict"):
            return errors
        by_field = {name: list(items) for name, items in errors.error_dict.items()}
        general = []
        # A violation carries only its message, made from the constraint's name.
        constraints = {
            c.get_violation_error_message(): c
            for c in self._meta.model._meta.constraints
            if isinstance(c, models.CheckConstraint)
        }
        for error in by_field.pop(NON_FIELD_ERRORS, []):
            constraint = constraints.get(str(error.message))
            if constraint is None:
                general.append(error)
                continue
            field, words = CONSTRAINT_WORDS.get(constraint.name, ("", UNNAMED_RULE))
            field = field or next((f for f in constraint_fields(constraint) if f in self.fields), "")
            if field in self.fields:
                by_field.setdefault(field, []).append(ValidationError(words, code="constraint"))
            else:
                general.append(ValidationError(words, code="constraint"))
        if general:
            by_field[NON_FIELD_ERRORS] = general
        return ValidationError(by_field)


class AuditedAdmin(KitAdmin[M]):
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
