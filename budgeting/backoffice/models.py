"""Admin-only model entries: proxies that give a page its own admin entry and permission."""

from __future__ import annotations

from budgeting.admission.models import Manifest


class UsageReport(Manifest):
    """The analysts' report page: a proxy so it gets its own admin entry and view permission."""

    class Meta:
        proxy = True
        default_permissions = ("view",)
        verbose_name = "usage report"
