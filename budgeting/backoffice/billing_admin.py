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
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString

from budgeting.backoffice.kit import ReadOnlyAdmin, ReasonForm, actor, change_url, confirm_page, link, require
from budgeting.backoffice.reservation_admin import link_to_reservation
from budgeting.catalog.changes import record_change
from ledger.models import Reservation
from reconciliation import billing
from reconciliation.models import BilledRequest, BillingFinding, BillingImport, BucketDrift, FindingKind

MAX_EXPORT_BYTES = 50 * 1024 * 1024

# The findings the imports list counts, by the annotation that holds the count.
FINDING_COUNTS = {
    "n_duplicates": FindingKind.DUPLICATE,
    "n_missing": FindingKind.MISSING,
    "n_mismatches": FindingKind.MISMATCH,
    "n_drifting": FindingKind.BUCKET_DRIFT,
}


def _count_column(annotation: str, title: str) -> Callable[[Any, BillingImport], int]:
    """A list column showing one of the import's finding counts, sortable by it."""

    def column(model_admin: Any, obj: BillingImport) -> int:
        return int(getattr(obj, annotation))

    return admin.display(description=title, ordering=annotation)(column)


class ImportForm(ReasonForm):
    export = forms.FileField(
        label="Billing export", help_text="The provider's export, as downloaded (UTF-8)."
    )
    fmt = forms.ChoiceField(label="Format", choices=[("csv", "CSV"), ("jsonl", "JSON lines")])
    field_order = ["export", "fmt", "reason"]

    def clean_export(self) -> Any:
        upload = self.cleaned_data["export"]
        if upload.size > MAX_EXPORT_BYTES:
            raise forms.ValidationError(f"at most {MAX_EXPORT_BYTES // (1024 * 1024)} MB")
        return upload


@admin.register(BillingImport)
class BillingImportAdmin(ReadOnlyAdmin[BillingImport]):
    list_display = [
        "imported_at",
        "source",
        "fmt",
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
        "fmt",
        "content_sha256",
        "records",
        "settled",
        "findings_count",
        "period_start",
        "period_end",
        "imported_at",
    ]
    change_form_template = "admin/reconciliation/billingimport/change_form.html"
    change_list_template = "admin/reconciliation/billingimport/change_list.html"

    duplicates = _count_column("n_duplicates", "duplicates")
    missing = _count_column("n_missing", "missing")
    mismatches = _count_column("n_mismatches", "mismatches")
    drifting_buckets = _count_column("n_drifting", "drifting buckets")

    def get_queryset(self, request: HttpRequest) -> QuerySet[BillingImport]:
        counts = {
            annotation: Count("findings", filter=Q(findings__kind=kind), distinct=True)
            for annotation, kind in FINDING_COUNTS.items()
        }
        return super().get_queryset(request).annotate(**counts)

    def page_context(self, request: HttpRequest, obj: BillingImport) -> dict[str, Any]:
        findings = obj.findings.all()
        return {
            "buckets": obj.buckets.all(),
            "findings_by_kind": [
                (label, [f for f in findings if f.kind == kind])
                for kind, label in FindingKind.choices
                if any(f.kind == kind for f in findings)
            ],
            "billed_requests": obj.billed_requests.count(),
        }

    def page_urls(self) -> list[tuple[str, Callable[..., HttpResponse], str]]:
        return [("upload/", self.upload_view, "reconciliation_billingimport_upload")]

    def upload_view(self, request: HttpRequest) -> HttpResponse:
        """Import a billing export: one call to the reconciliation service, then its summary."""
        require(request, "reconciliation.add_billingimport")
        form = ImportForm(request.POST or None, request.FILES or None)
        if request.method == "POST" and form.is_valid():
            upload = form.cleaned_data["export"]
            try:
                text = upload.read().decode("utf-8")
            except UnicodeDecodeError:
                form.add_error("export", "the file is not UTF-8 text")
            else:
                result = billing.import_export(
                    text=text, fmt=form.cleaned_data["fmt"], source=upload.name, now=timezone.now()
                )
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
                    messages.success(request, f"Imported {upload.name}: {result.summary()}")
                else:
                    messages.warning(request, f"{upload.name} was imported before; nothing changed.")
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
        "billed_input",
        "captured_input",
        "input_drift",
        "billed_output",
        "captured_output",
        "output_drift",
    ]
    list_filter = ["model", "billing_import"]
    date_hierarchy = "bucket_start"

    @admin.display(description="input drift")
    def input_drift(self, obj: BucketDrift) -> SafeString:
        return _drift(obj.drift_input)

    @admin.display(description="output drift")
    def output_drift(self, obj: BucketDrift) -> SafeString:
        return _drift(obj.drift_output)


def _drift(value: int) -> SafeString:
    if value == 0:
        return format_html("{}", 0)
    return format_html('<span class="tb-neg">{}</span>', f"{value:+,}")


@admin.register(BilledRequest)
class BilledRequestAdmin(ReadOnlyAdmin[BilledRequest]):
    list_display = [
        "provider_request_id",
        "model",
        "input_tokens",
        "output_tokens",
        "start_time",
        "reservation",
    ]
    list_filter = ["model", "billing_import"]
    search_fields = ["=provider_request_id"]
    date_hierarchy = "start_time"

    @admin.display(description="reservation")
    def reservation(self, obj: BilledRequest) -> SafeString | str:
        found = Reservation.objects.filter(provider_request_id=obj.provider_request_id).values_list(
            "pk", flat=True
        )
        return link_to_reservation(found.first())
