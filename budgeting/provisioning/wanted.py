"""What a provisioning file asks for (``Wanted``: an object, how to find it, the fields the file keeps in
line) and the values as a file states them (relations by natural key, decimals as fixed-point text)."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from typing import Any, cast

from django.db import models

from budgeting.catalog.models import (
    ModelPool,
    ModelRevision,
    PolicyVersion,
    ServiceClient,
    TaskClass,
    Tenant,
    Tokenizer,
)

NATURAL_KEYS: dict[type[models.Model], str] = {
    Tokenizer: "name",
    ModelPool: "slug",
    ModelRevision: "name",
    TaskClass: "slug",
    Tenant: "slug",
    ServiceClient: "name",
    PolicyVersion: "revision",
}
"""How a file names the objects other objects refer to."""


@dataclass(frozen=True)
class Field:
    """One field a file sets: the model field, the file's key for it, and the value the file wants.

    Values are JSON: a relation is the natural key of its target, a many-to-many the sorted natural keys, a
    decimal its fixed-point text at the field's precision ("0.270000").
    """

    name: str
    key: str
    value: Any


@dataclass(frozen=True)
class Wanted:
    """One object a file describes: how to find it (``lookup``, relations by natural key), the fields the file
    keeps in line, and values written only when the object is created."""

    kind: str
    label: str
    model: type[models.Model]
    lookup: dict[str, Any]
    fields: tuple[Field, ...]
    on_create: dict[str, Any]


def wanted(
    kind: str,
    label: str,
    model: type[models.Model],
    lookup: dict[str, Any],
    fields: list[tuple[str, str, Any]],
    on_create: dict[str, Any] | None = None,
) -> Wanted:
    return Wanted(kind, label, model, lookup, tuple(Field(n, k, v) for n, k, v in fields), on_create or {})


def known(model: type[models.Model], named_in_file: list[Wanted]) -> set[Any]:
    """Natural keys that may be referred to: those in the database and those the file itself describes."""
    key = NATURAL_KEYS[model]
    in_file = {w.lookup[key] for w in named_in_file if w.model is model}
    return set(model._default_manager.values_list(key, flat=True)) | in_file


def related_model(field: Any) -> type[models.Model]:
    return cast(type[models.Model], field.related_model)


def fixed_point(value: Decimal, field: models.DecimalField[Any, Any]) -> str:
    """A decimal as a file states it: fixed-point text at the field's precision, so "0.27" in a file and
    0.270000 in the database compare equal (and the value stays JSON for plans and ``ProvisionedValue``)."""
    return f"{value.quantize(Decimal(1).scaleb(-(field.decimal_places or 0))):f}"


def present(obj: models.Model, name: str) -> Any:
    """A field's value as a file states it: relations by natural key, many-to-many sorted, decimals as
    fixed-point text."""
    field = obj._meta.get_field(name)
    if field.many_to_many:
        key = NATURAL_KEYS[related_model(field)]
        return sorted(getattr(target, key) for target in getattr(obj, name).all())
    if field.is_relation:
        target = getattr(obj, name)
        return None if target is None else getattr(target, NATURAL_KEYS[related_model(field)])
    value = getattr(obj, name)
    if isinstance(field, models.DecimalField) and value is not None:
        return fixed_point(Decimal(value), field)
    return value
