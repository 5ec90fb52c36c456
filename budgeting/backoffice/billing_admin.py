"""Reconciliation in the admin: billing imports with their drift per bucket, duplicates and missing records.

Finance uploads a provider's billing export from the imports list ("Import a billing export…"); the import
itself is ``reconciliation.billing.import_export`` (it settles RECONCILING reservations at the billed usage
and records findings). Everything here is read-only otherwise. The RECONCILING backlog is a page of the
reservations admin (``reservation_admin``), linked from the imports list.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.db.models import Count, Q, QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.defaultfilters import pluralize
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString

from budgeting.backoffice.formats import count, signed
from budgeting.backoffice.kit import (
    ReadOnlyAdmin,
    ReasonForm,
    actor,
    change_url,
    confirm_page,
    figure_column,
    link,
    problem_message,
    require,
)
from budgeting.backoffice.reservation_admin import link_to_reservation
from budgeting.catalog.changes import record_change
from budgeting.catalog.errors import DomainError
from ledger.models import Reservation
from reconciliation import billing
from reconciliation.models import BilledRequest, BillingFinding, BillingImport, BucketDrift, FindingKind
from reconciliation.providers.exports import EXPORT_FORMAT_CHOICES

MAX_EXPORT_BYTES = 50 * 1024 * 1024
FORMAT_LABELS = dict(EXPORT_FORMAT_CHOICES)

# The findings the imports list counts, by the annotation that holds the count.
FINDING_COUNTS = {
    "n_duplicates": FindingKind.DUPLICATE,
    "n_missing": FindingKind.MISSING,
    "n_mismatches": FindingKind.MISMATCH,
    "n_drifting": FindingKind.BUCKET_DRIFT,
}


class ImportForm(ReasonForm):
    export = forms.FileField(
        label="Billing export", help_text="The provider's export, as downloaded (UTF-8)."
    )
    fmt = forms.ChoiceField(label="Format", choices=EXPORT_FORMAT_CHOICES)
    field_order = ["export", "fmt", "reason"]

    def clean_export(self) -> Any:
        upload = self.cleaned_data["export"]
        if upload.size > MAX_EXPORT_BYTES:
            raise forms.ValidationError(
                f"The file is too large: an export can be at most {MAX_EXPORT_BYTES // (1024 * 1024)} MB."
            )
        return upload


def import_sentence(billing_import: BillingImport) -> str:
    """An import's result in words: "Imported sample.csv: 12 records, 3 reservations settled, 2 findings
    (1 missing, 1 mismatch)."."""
    counts: dict[str, int] = {}
    for kind in billing_import.findings.values_list("kind", flat=True):
        counts[kind] = counts.get(kind, 0) + 1
    findings = ", ".join(f"{count(n)} {kind.lower().replace('_', ' ')}" for kind, n in sorted(counts.items()))
    total = sum(counts.values())
    return (
        f"Imported {billing_import.source}: {count(billing_import.records)} record"
        f"{pluralize(billing_import.records)}, {count(billing_import.settled)} reservation"
        f"{pluralize(billing_import.settled)} settled, "
        + (f"{count(total)} finding{pluralize(total)} ({findings})." if total else "no findings.")
    )


@admin.register(BillingImport)
class BillingImportAdmin(ReadOnlyAdmin[BillingImport]):
    list_display = [
        "imported_at",
        "source",
        "format_label",
        "records",
        "settled",
        "duplicates",
        "missing",
        "mismatches",
        "drifting_buckets",
        "period_start",
        "period_end",
    ]
    list_filter = ["fmt", "imported_at"]
    search_fields = ["source", "content_sha256"]
    date_hierarchy = "imported_at"
    fields = [
        "source",
        "format_label",
        "content_sha256",
        "period_start",
        "period_end",
        "imported_at",
    ]
    readonly_fields = ["format_label"]
    change_form_template = "admin/reconciliation/billingimport/change_form.html"
    change_list_template = "admin/reconciliation/billingimport/change_list.html"

    duplicates = figure_column("n_duplicates", "duplicates")
    missing = figure_column("n_missing", "missing")
    mismatches = figure_column("n_mismatches", "mismatches")
    drifting_buckets = figure_column("n_drifting", "drifting buckets")

    @admin.display(description="format", ordering="fmt")
    def format_label(self, obj: BillingImport) -> str:
        return FORMAT_LABELS.get(obj.fmt, obj.fmt)

    def get_queryset(self, request: HttpRequest) -> QuerySet[BillingImport]:
        counts = {
            annotation: Count("findings", filter=Q(findings__kind=kind), distinct=True)
            for annotation, kind in FINDING_COUNTS.items()
        }
        return super().get_queryset(request).annotate(**counts)

    def page_context(self, request: HttpRequest, obj: BillingImport) -> dict[str, Any]:
        findings = obj.findings.all()
        return {
            "result": import_sentence(obj),
            "finding_counts": [
                (label, sum(1 for f in findings if f.kind == kind))
                for kind, label in FindingKind.choices
                if any(f.kind == kind for f in findings)
            ],
            "buckets": obj.buckets.all(),
            "findings_by_kind": [
                (label, [f for f in findings if f.kind == kind])
                for kind, label in FindingKind.choices
                if any(f.kind == kind for f in findings)
            ],
            "billed_requests": obj.billed_requests.count(),
            "can_remove": request.user.has_perm("reconciliation.add_billingimport")
            and not (obj.records or obj.settled),
        }

    def page_urls(self) -> list[tuple[str, Callable[..., HttpResponse], str]]:
        return [
            ("upload/", self.upload_view, "reconciliation_billingimport_upload"),
            ("<int:import_id>/remove/", self.remove_view, "reconciliation_billingimport_remove"),
        ]

    def remove_view(self, request: HttpRequest, import_id: int) -> HttpResponse:
        """Remove an import that stored nothing (a file refused today was accepted before): a reason, then
        one call to the reconciliation service, which keeps it in the change log."""
        require(request, "reconciliation.add_billingimport")
        billing_import = self.object_or_404(request, import_id)
        form = ReasonForm(request.POST or None)
        if request.method == "POST" and form.is_valid():
            try:
                billing.remove_failed_import(
                    import_id=billing_import.pk, reason=form.cleaned_data["reason"], actor=actor(request)
                )
            except DomainError as problem:
                problem_message(request, problem)
                return HttpResponseRedirect(change_url(billing_import))
            messages.success(request, f"Import {billing_import.source} removed; the change log keeps it.")
            return HttpResponseRedirect(reverse("admin:reconciliation_billingimport_changelist"))
        return confirm_page(
            request,
            self,
            obj=billing_import,
            title=f"Remove the import of {billing_import.source}",
            lead="This import read no record: it settled nothing and stored no billed usage, only the lines "
            "it could not read. Removing it deletes it and its findings; the change log keeps what it was.",
            form=form,
            submit="Remove import",
            cancel_url=change_url(billing_import),
            rows=[
                ("file", billing_import.source, "—", True),
                ("format", FORMAT_LABELS.get(billing_import.fmt, billing_import.fmt), "—", False),
                ("lines it could not read", count(billing_import.findings.count()), "—", False),
            ],
            danger=True,
        )

    def upload_view(self, request: HttpRequest) -> HttpResponse:
        """Import a billing export: one call to the reconciliation service, then its summary."""
        require(request, "reconciliation.add_billingimport")
        form = ImportForm(request.POST or None, request.FILES or None)
        if request.method == "POST" and form.is_valid():
            upload = form.cleaned_data["export"]
            result: billing.ImportResult | None = None
            try:
                text = upload.read().decode("utf-8")
            except UnicodeDecodeError:
                form.add_error(
                    "export", "The file is not UTF-8 text: export it again as UTF-8 (CSV or JSON)."
                )
            else:
                try:
                    result = billing.import_export(
                        text=text, fmt=form.cleaned_data["fmt"], source=upload.name, now=timezone.now()
                    )
                except billing.ExportRefused as refused:
                    form.add_error("export", refused.detail)
                    result = None
            if result is not None:
                if result.created:
                    # The import commits its own transactions (one per settled reservation); the log entry
                    # follows it, naming the import so the two can be matched.
                    record_change(
                        actor=actor(request),
                        action="billing.import",
                        target=result.billing_import,
                        before=None,
                        after=result.summary(),
                        reason=form.cleaned_data["reason"],
                    )
                    messages.success(request, import_sentence(result.billing_import))
                else:
                    messages.warning(
                        request, f"{upload.name} was imported before (same content); nothing changed."
                    )
                return HttpResponseRedirect(change_url(result.billing_import))
        return confirm_page(
            request,
            self,
            title="Import a billing export",
            lead="Per-request records settle reservations whose outcome was unknown at the billed usage; "
            "every other difference is recorded as a finding. Importing the same file again changes nothing.",
            form=form,
            submit="Import",
            cancel_url=reverse("admin:reconciliation_billingimport_changelist"),
            multipart=True,
        )


@admin.register(BillingFinding)
class BillingFindingAdmin(ReadOnlyAdmin[BillingFinding]):
    list_display = ["id", "kind", "import_link", "provider_request_id", "line", "detail"]
    list_filter = ["kind", "billing_import"]
    search_fields = ["provider_request_id", "detail"]
    list_select_related = ["billing_import"]

    @admin.display(description="import")
    def import_link(self, obj: BillingFinding) -> SafeString:
        return link(change_url(obj.billing_import), obj.billing_import)


@admin.register(BucketDrift)
class BucketDriftAdmin(ReadOnlyAdmin[BucketDrift]):
    list_display = [
        "bucket_start",
        "bucket_end",
        "model",
        "api_key_id",
        "billed_input_col",
        "captured_input_col",
        "input_drift",
        "billed_output_col",
        "captured_output_col",
        "output_drift",
    ]
    list_filter = ["model", "billing_import"]
    date_hierarchy = "bucket_start"

    billed_input_col = figure_column("billed_input", "billed input tokens")
    captured_input_col = figure_column("captured_input", "captured input tokens")
    billed_output_col = figure_column("billed_output", "billed output tokens")
    captured_output_col = figure_column("captured_output", "captured output tokens")

    @admin.display(description="input drift (tokens)")
    def input_drift(self, obj: BucketDrift) -> SafeString:
        return _drift(obj.drift_input)

    @admin.display(description="output drift (tokens)")
    def output_drift(self, obj: BucketDrift) -> SafeString:
        return _drift(obj.drift_output)


def _drift(value: int) -> SafeString:
    if value == 0:
        return format_html("{}", 0)
    return format_html('<span class="tb-neg">{}</span>', signed(value))


@admin.register(BilledRequest)
class BilledRequestAdmin(ReadOnlyAdmin[BilledRequest]):
    list_display = [
        "provider_request_id",
        "model",
        "input_col",
        "output_col",
        "start_time",
        "reservation",
    ]
    list_filter = ["model", "billing_import"]
    search_fields = ["=provider_request_id"]
    date_hierarchy = "start_time"

    input_col = figure_column("input_tokens", "input tokens")
    output_col = figure_column("output_tokens", "output tokens")

    @admin.display(description="reservation")
    def reservation(self, obj: BilledRequest) -> SafeString | str:
        found = Reservation.objects.filter(provider_request_id=obj.provider_request_id).values_list(
            "pk", flat=True
        )
        return link_to_reservation(found.first())
