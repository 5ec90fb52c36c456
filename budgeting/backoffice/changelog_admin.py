"""The change log's admin: every privileged change with who, when, why, and the values before and after."""

from __future__ import annotations

import json
from typing import Any

from django.contrib import admin
from django.urls import NoReverseMatch, reverse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from budgeting.backoffice.kit import ReadOnlyAdmin, link
from budgeting.catalog.models import ChangeRecord


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


@admin.register(ChangeRecord)
class ChangeRecordAdmin(ReadOnlyAdmin[ChangeRecord]):
    list_display = ["at", "actor_username", "action", "target", "short_reason"]
    list_filter = ["action", "actor_username", "target_type"]
    search_fields = ["target_repr", "reason", "actor_username", "target_id"]
    date_hierarchy = "at"
    change_list_template = "admin/tokenbudget/wide_change_list.html"
    fields = ["at", "actor_username", "action", "target", "reason", "changes"]

    @admin.display(description="target")
    def target(self, obj: ChangeRecord) -> str:
        app_label, _, model_name = obj.target_type.partition(".")
        try:
            url = reverse(f"admin:{app_label}_{model_name}_change", args=[obj.target_id])
        except NoReverseMatch:  # a model without an admin page: show the name only
            return obj.target_repr
        return link(url, obj.target_repr)

    @admin.display(description="reason")
    def short_reason(self, obj: ChangeRecord) -> str:
        return obj.reason if len(obj.reason) <= 80 else obj.reason[:79] + "…"

    @admin.display(description="before → after")
    def changes(self, obj: ChangeRecord) -> SafeString:
        return change_table(obj.before, obj.after)
