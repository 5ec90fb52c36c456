"""Sign-in lockouts in the admin (django-axes' records, on our pages): who is locked out and why, every failed
sign-in ("Access failures"), and lifting a lockout, which asks for a reason and lands in the change log."""

from __future__ import annotations

from typing import Any

from axes.models import AccessAttempt, AccessFailureLog, AccessLog
from django.conf import settings
from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse

from budgeting.backoffice.kit import ReadOnlyAdmin, ReasonForm, actor, admin_page, require
from budgeting.backoffice.lockouts import lift_lockouts


@admin.register(AccessAttempt)
class LockoutAdmin(ReadOnlyAdmin[AccessAttempt]):
    """A username or address counting failed sign-ins; at the failure limit it is locked out."""

    list_display = ["username", "ip_address", "failures", "status", "attempt_time", "user_agent"]
    list_filter = ["attempt_time"]
    search_fields = ["username", "ip_address"]
    date_hierarchy = "attempt_time"
    fields = ["username", "ip_address", "failures_since_start", "attempt_time", "path_info", "user_agent"]
    actions = ["lift"]

    @admin.display(description="failures", ordering="failures_since_start")
    def failures(self, obj: AccessAttempt) -> str:
        return f"{obj.failures_since_start} of {settings.AXES_FAILURE_LIMIT}"

    @admin.display(description="status")
    def status(self, obj: AccessAttempt) -> str:
        return "locked out" if obj.failures_since_start >= settings.AXES_FAILURE_LIMIT else "counting"

    def get_actions(self, request: HttpRequest) -> dict[str, Any]:
        actions = super().get_actions(request)
        if not request.user.has_perm("axes.delete_accessattempt"):
            actions.pop("lift", None)
        return actions

    @admin.action(description="Lift the selected lockouts…")
    def lift(self, request: HttpRequest, queryset: QuerySet[AccessAttempt]) -> HttpResponse | None:
        require(request, "axes.delete_accessattempt")
        attempts = list(queryset)
        form = ReasonForm(request.POST if "reason" in request.POST else None)
        if form.is_valid():
            lifted = lift_lockouts(
                attempt_ids=[a.pk for a in attempts], reason=form.cleaned_data["reason"], actor=actor(request)
            )
            messages.success(request, f"{lifted} lockout(s) lifted; the change log keeps who and why.")
            return None
        return admin_page(
            request,
            self,
            "admin/tokenbudget/action_confirm.html",
            {
                "title": "Lift sign-in lockouts",
                "lead": "These usernames and addresses may sign in again at once; their failure counts are "
                "forgotten. The failed attempts stay under Access failures.",
                "objects": attempts,
                "form": form,
                "action": "lift",
                "submit": "Lift lockouts",
                "danger": True,
            },
        )


@admin.register(AccessFailureLog)
class AccessFailureAdmin(ReadOnlyAdmin[AccessFailureLog]):
    """Every failed sign-in, kept (settings.AXES_ENABLE_ACCESS_FAILURE_LOG)."""

    list_display = ["attempt_time", "username", "ip_address", "locked_out", "user_agent"]
    list_filter = ["locked_out", "attempt_time"]
    search_fields = ["username", "ip_address"]
    date_hierarchy = "attempt_time"
    fields = ["attempt_time", "username", "ip_address", "locked_out", "path_info", "user_agent"]


@admin.register(AccessLog)
class SignInAdmin(ReadOnlyAdmin[AccessLog]):
    """Successful sign-ins and sign-outs."""

    list_display = ["attempt_time", "logout_time", "username", "ip_address", "user_agent"]
    list_filter = ["attempt_time"]
    search_fields = ["username", "ip_address"]
    date_hierarchy = "attempt_time"
    fields = ["attempt_time", "logout_time", "username", "ip_address", "path_info", "user_agent"]
