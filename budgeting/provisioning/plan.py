"""The plan of a provisioning file: what applying it would change, object by object and field by field, and
which values people changed since the file's last apply (kept, or overridden when forced).

A field is the file's to change when its value is still the one the file last wrote (``ProvisionedValue``).
A field the file never wrote counts as people's when the change log shows a person (or any actor other than a
provisioning file) changing it. An account's limits are compared without the active temporary increases, which
ride on top of whatever limit the file sets.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from django.db import models
from django.db.models import Sum

from budgeting.catalog.models import ChangeRecord, ModelPool, TemporaryIncrease
from budgeting.provisioning.models import ProvisionedValue
from budgeting.provisioning.source import ACTOR_PREFIX, Source
from budgeting.provisioning.wanted import NATURAL_KEYS, Wanted, present, related_model
from ledger.models import CapacityAccount

INCREASE_AMOUNTS = {
    "input_limit": "input_tokens",
    "output_limit": "output_tokens",
    "concurrency_limit": "concurrency",
    "spend_limit": "spend",
}
"""Which amount of a temporary increase rides on which account limit."""

TIED_FIELDS: dict[type[models.Model], frozenset[str]] = {ModelPool: frozenset({"provider", "adapter"})}
"""Fields a check constraint pairs: when people's value of one is kept, the file's value of the other is kept
too, so that an apply never writes a pair the database refuses (a pool's adapter belongs to its provider)."""


class Outcome(StrEnum):
    SET = "set"
    """The file's value is written (the field still holds what the file wrote last, or the object is new)."""
    KEPT = "kept"
    """People changed the field since the file's last apply: their value stays."""
    OVERRIDE = "override"
    """People changed the field, and ``--force`` writes the file's value over theirs."""


@dataclass(frozen=True)
class FieldPlan:
    """One field whose value differs from the file's: ``old`` is the current value, ``new`` the file's."""

    name: str
    key: str
    old: Any
    new: Any
    outcome: Outcome
    note: str = ""


@dataclass(frozen=True)
class ObjectPlan:
    """One object of the file: created (``pk`` None, every field listed) or the fields that differ.

    ``observed`` are the stored values of the file's fields (an account's limits with their temporary
    increases) and ``offsets`` the active temporary increases per account limit.
    """

    wanted: Wanted
    pk: int | None
    fields: tuple[FieldPlan, ...]
    observed: dict[str, Any]
    offsets: dict[str, int]

    @property
    def writes(self) -> tuple[FieldPlan, ...]:
        return tuple(f for f in self.fields if f.outcome != Outcome.KEPT)


@dataclass(frozen=True)
class Plan:
    source: Source
    force: bool
    objects: tuple[ObjectPlan, ...]

    def _count(self, outcome: Outcome) -> int:
        return sum(1 for o in self.objects if o.pk is not None for f in o.fields if f.outcome == outcome)

    @property
    def changed(self) -> bool:
        """Applying the plan would write something."""
        return any(o.writes for o in self.objects)

    def summary(self) -> str:
        created = sum(1 for o in self.objects if o.pk is None)
        changed = [o for o in self.objects if o.pk is not None and o.writes]
        parts = []
        if created:
            parts.append(f"{created} to create")
        if changed:
            fields = sum(len(o.writes) for o in changed)
            parts.append(f"{len(changed)} to change ({fields} field{'s' * (fields != 1)})")
        overridden, kept = self._count(Outcome.OVERRIDE), self._count(Outcome.KEPT)
        if overridden:
            parts.append(f"{overridden} value{'s' * (overridden != 1)} people changed overridden (--force)")
        if kept:
            parts.append(f"{kept} value{'s' * (kept != 1)} people changed kept (--force overrides)")
        same = len(self.objects) - created - len(changed)
        if same or not parts:
            parts.append(f"{same} object{'s' * (same != 1)} as in the file")
        return ("" if self.changed else "no changes; ") + ", ".join(parts)


def make_plan(wanted: Sequence[Wanted], source: Source, *, force: bool) -> Plan:
    """Compare the file's objects with the database (nothing is written)."""
    return Plan(source, force, tuple(_object_plan(w, force) for w in wanted))


def lookup_filter(model: type[models.Model], lookup: dict[str, Any]) -> dict[str, Any]:
    """The ORM filter for a lookup whose relations are natural keys."""
    out = {}
    for name, value in lookup.items():
        field = model._meta.get_field(name)
        if field.is_relation and value is not None:
            out[f"{name}__{NATURAL_KEYS[related_model(field)]}"] = value
        else:
            out[name] = value
    return out


def _object_plan(w: Wanted, force: bool) -> ObjectPlan:
    obj = w.model._default_manager.filter(**lookup_filter(w.model, w.lookup)).first()
    if obj is None:
        created = tuple(FieldPlan(f.name, f.key, None, f.value, Outcome.SET) for f in w.fields)
        return ObjectPlan(w, None, created, {}, {})
    observed = {f.name: present(obj, f.name) for f in w.fields}
    offsets = _active_increases(obj) if isinstance(obj, CapacityAccount) else {}
    recorded = dict(
        ProvisionedValue.objects.filter(target_type=obj._meta.label_lower, target_id=str(obj.pk)).values_list(
            "field", "value"
        )
    )
    plans = []
    for f in w.fields:
        offset = offsets.get(f.name, 0)
        current = observed[f.name]
        if current is not None and offset:
            current -= offset
        if current == f.value:
            continue
        people = _last_change_by_others(obj, f.name)
        # What the file wrote last is the baseline; a field it never wrote is people's if the log says so.
        untouched = recorded[f.name] == current if f.name in recorded else people is None
        if untouched:
            note = (
                "" if not offset or f.value is None else f"active temporary increases of {offset} stay on top"
            )
            plans.append(FieldPlan(f.name, f.key, current, f.value, Outcome.SET, note))
        else:
            outcome = Outcome.OVERRIDE if force else Outcome.KEPT
            plans.append(FieldPlan(f.name, f.key, current, f.value, outcome, _who(people)))
    return ObjectPlan(w, obj.pk, _keep_tied(w.model, plans), observed, offsets)


def _keep_tied(model: type[models.Model], plans: list[FieldPlan]) -> tuple[FieldPlan, ...]:
    """Keep the file's value of a tied field (``TIED_FIELDS``) when people's value of its partner is kept."""
    tied = TIED_FIELDS.get(model, frozenset())
    kept = next((p for p in plans if p.name in tied and p.outcome == Outcome.KEPT), None)
    if kept is None:
        return tuple(plans)
    return tuple(
        replace(p, outcome=Outcome.KEPT, note=f"kept with {kept.key}, {kept.note}")
        if p.name in tied and p.outcome == Outcome.SET
        else p
        for p in plans
    )


def _active_increases(account: CapacityAccount) -> dict[str, int]:
    totals = TemporaryIncrease.objects.filter(account=account, ended_at__isnull=True).aggregate(
        **{limit: Sum(amount) for limit, amount in INCREASE_AMOUNTS.items()}
    )
    return {limit: total for limit, total in totals.items() if total}


def _last_change_by_others(obj: models.Model, name: str) -> ChangeRecord | None:
    """The latest change-log entry of another actor than a provisioning file that changed the field."""
    entries = ChangeRecord.objects.filter(target_type=obj._meta.label_lower, target_id=str(obj.pk)).exclude(
        actor_username__startswith=ACTOR_PREFIX
    )
    for entry in entries.order_by("-at", "-id"):
        after, before = entry.after, entry.before
        if (
            isinstance(after, dict)
            and name in after
            and (not isinstance(before, dict) or before.get(name) != after[name])
        ):
            return entry
    return None


def _who(entry: ChangeRecord | None) -> str:
    if entry is None:
        return "changed outside the change log"
    reason = entry.reason if len(entry.reason) <= 60 else entry.reason[:59] + "…"
    return f"changed by {entry.actor_username} at {entry.at:%Y-%m-%d %H:%M} UTC ({entry.action}: {reason!r})"


def render(plan: Plan) -> list[str]:
    """The plan as text: created objects one per line, changed objects field by field, then the summary."""
    lines = [f"Plan for {plan.source.name} (sha256:{plan.source.digest[:12]}):"]
    for item in plan.objects:
        w = item.wanted
        if item.pk is None:
            shown = ", ".join(f"{f.key} {show(f.new)}" for f in item.fields)
            lines.append(f"  + {w.kind} {w.label}" + (f": {shown}" if shown else ""))
        elif item.fields:
            lines.append(f"  {'~' if item.writes else '='} {w.kind} {w.label}")
            lines.extend(f"      {_field_line(f)}" for f in item.fields)
    lines.append(plan.summary())
    return lines


def _field_line(f: FieldPlan) -> str:
    if f.outcome == Outcome.KEPT:
        return f"{f.key}: kept {show(f.old)} (file: {show(f.new)}), {f.note}"
    line = f"{f.key}: {show(f.old)} -> {show(f.new)}"
    if f.outcome == Outcome.OVERRIDE:
        return f"{line}  OVERRIDES people's value, {f.note}"
    return f"{line}  ({f.note})" if f.note else line


def show(value: Any) -> str:
    """A value as JSON, shortened when long (a policy document is shown by its digest)."""
    text = json.dumps(value, ensure_ascii=False, sort_keys=True)
    if len(text) <= 80:
        return text
    if isinstance(value, str):
        return json.dumps(value[:70], ensure_ascii=False) + "…"
    return f"{text[:40]}… (sha256:{hashlib.sha256(text.encode()).hexdigest()[:12]})"
