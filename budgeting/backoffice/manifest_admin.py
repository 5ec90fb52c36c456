"""The manifests' admin: each admission's record (read-only), its replay, and the usage report and tenant
spend pages."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404
from django.urls import URLPattern, path

from budgeting.admission.models import Manifest
from budgeting.admission.replay import replay_manifest
from budgeting.backoffice.formats import count
from budgeting.backoffice.kit import ReadOnlyAdmin, admin_context, admin_page, figure_column, require
from budgeting.backoffice.models import UsageReport
from budgeting.backoffice.reports.views import report_page, tenant_spend_page
from budgeting.catalog.models import Tenant


def readable(value: Any) -> str | None:
    """A recorded value as a person reads it: counts with separators, an object as "key value" pairs (never
    a Python dict), a list joined; ``None`` stays None (shown as "—")."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return count(value)
    if isinstance(value, dict):
        return " · ".join(f"{key} {readable(item) or '—'}" for key, item in value.items())
    if isinstance(value, list):
        return ", ".join(readable(item) or "—" for item in value)
    return str(value)


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
        "locked": [
            (name, readable(value)) for name, value in sorted((record.get("lockedRevisions") or {}).items())
        ],
        "components": components,
        "steps": record.get("steps") or [],
        "removed": record.get("removed") or [],
        "excluded": record.get("excluded") or [],
        "hard_bucket_changes": record.get("hardBucketChanges", 0),
        "rungs_tried": record.get("rungsTried") or [],
        "record_json": json.dumps(record, indent=2, ensure_ascii=False),
    }


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
        "input_tokens_col",
        "count_method",
    ]
    input_tokens_col = figure_column("input_tokens", "input tokens")
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
        "input_tokens_col",
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

    def page_context(self, request: HttpRequest, obj: Manifest) -> dict[str, Any]:
        return manifest_context(obj)

    def page_urls(self) -> list[tuple[str, Callable[..., HttpResponse], str]]:
        return [("<int:manifest_id>/replay/", self.replay_view, "budgeting_manifest_replay")]

    def replay_view(self, request: HttpRequest, manifest_id: int) -> HttpResponse:
        """Re-run the decision from the manifest and show whether it matches the record (read-only)."""
        require(request, "budgeting.view_manifest")
        manifest = self.object_or_404(request, manifest_id)
        return admin_page(
            request,
            self,
            "admin/budgeting/manifest/replay.html",
            {
                "original": manifest,
                "title": f"Replay of {manifest.request_id}",
                "result": replay_manifest(manifest.pk),
            },
        )


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
        return report_page(request, {**admin_context(request, self), **(extra_context or {})})

    def tenant_view(self, request: HttpRequest, slug: str) -> HttpResponse:
        """A tenant's spend this month, by model revision and task class."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        tenant = get_object_or_404(Tenant, slug=slug)
        return tenant_spend_page(request, admin_context(request, self), tenant)

    def get_urls(self) -> list[URLPattern]:
        wrap = self.admin_site.admin_view
        return [
            path("", wrap(self.changelist_view), name="budgeting_usagereport_changelist"),
            path("tenant/<str:slug>/", wrap(self.tenant_view), name="budgeting_usagereport_tenant"),
        ]
