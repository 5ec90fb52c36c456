"""Reconciliation in the admin: billing imports and their findings, read-only.

The billing import models arrive with the reconciliation issue; until then this module registers nothing and
the RECONCILING backlog (``ledger.admin``, Reservations → "Reconciling backlog") is the reconciliation page.
Imports are run by the reconciliation service; the admin shows them and what they found.
"""

from __future__ import annotations

from typing import Any

from django.apps import apps
from django.contrib import admin
from django.db import models

from budgeting.admin import ReadOnlyAdmin

BILLING_MODELS = ("BillingImport", "BillingFinding")


def _model(name: str) -> type[models.Model] | None:
    try:
        return apps.get_model("reconciliation", name)
    except LookupError:
        return None


def _admin_for(model: type[models.Model]) -> type[admin.ModelAdmin[Any]]:
    """A read-only admin showing the model's own fields, filterable by its choice and boolean fields."""
    fields = [f for f in model._meta.concrete_fields if not isinstance(f, models.JSONField)]
    filters = [f.name for f in fields if f.choices or isinstance(f, models.BooleanField | models.ForeignKey)]
    dates = [f.name for f in fields if isinstance(f, models.DateTimeField)]
    return type(
        f"{model.__name__}Admin",
        (ReadOnlyAdmin,),
        {
            "list_display": [f.name for f in fields][:10],
            "list_filter": filters[:6],
            "date_hierarchy": dates[0] if dates else None,
        },
    )


for _name in BILLING_MODELS:
    _billing = _model(_name)
    if _billing is not None and not admin.site.is_registered(_billing):
        admin.site.register(_billing, _admin_for(_billing))
