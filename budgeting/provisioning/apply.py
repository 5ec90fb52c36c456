"""Applying a provisioning plan as it was shown, every change in the change log under the file's name.

The catalog (and new accounts) is written in one transaction, each object saved and logged as the admin does.
The limits of existing accounts then go through the ledger (``set_account_limits``) and policy aliases
through their compare-and-swap (``activate``): both own their transactions, so they run after the commit,
each checked against the values the plan saw. What the file wrote is remembered (``ProvisionedValue``) so
that the next plan can tell people's changes from the file's own.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from django.db import models, transaction
from django.utils import timezone

from budgeting.catalog.changes import record_change, snapshot
from budgeting.catalog.errors import DomainError
from budgeting.catalog.models import (
    ModelPool,
    ModelRevision,
    PolicyAlias,
    PolicyVersion,
    Price,
    ServiceClient,
    TaskClass,
    Tenant,
    Tokenizer,
)
from budgeting.catalog.policies import activate
from budgeting.provisioning.document import read_document
from budgeting.provisioning.models import ProvisionedValue
from budgeting.provisioning.plan import FieldPlan, ObjectPlan, Outcome, Plan, make_plan
from budgeting.provisioning.source import ProvisioningError, Source
from budgeting.provisioning.wanted import NATURAL_KEYS, related_model
from ledger.models import CapacityAccount, Reservation
from ledger.services.accounts import forget_account_cache
from ledger.services.limits import LIMIT_FIELDS, set_account_limits

PROVISIONED_MODELS: tuple[type[models.Model], ...] = (
    Tokenizer,
    ModelPool,
    ModelRevision,
    TaskClass,
    Tenant,
    CapacityAccount,
    ServiceClient,
    PolicyVersion,
    Price,
)


def is_empty() -> bool:
    """Nothing a provisioning file describes exists yet: no tokenizer, pool, model revision, task class,
    tenant, account, service client, policy version or price. ``./platform run`` applies its demo file only
    then."""
    return not any(model._default_manager.exists() for model in PROVISIONED_MODELS)


class PlanChanged(Exception):
    """The database no longer matches the plan that was shown; nothing was applied."""


@dataclass(frozen=True)
class Applied:
    """An applied plan; ``conflicts`` name the account limits and aliases that changed while applying (they
    were left as they were)."""

    plan: Plan
    conflicts: tuple[str, ...]

    @property
    def changed(self) -> bool:
        return self.plan.changed

    def summary(self) -> str:
        text = ("applied: " if self.plan.changed else "") + self.plan.summary()
        if self.conflicts:
            text += "; not applied, changed meanwhile (run again to review): " + "; ".join(self.conflicts)
        return text


def apply_config(
    doc: Any,
    *,
    source: Source | None = None,
    force: bool = False,
    now: datetime | None = None,
    tokenizer_dir: Path | None = None,
) -> Applied:
    """Read, plan and apply a document without showing the plan (scripts and tests).

    Raises ProvisioningError naming the first bad field; nothing is applied then.
    """
    now = now or timezone.now()
    wanted = read_document(doc, now=now, tokenizer_dir=tokenizer_dir)
    return apply_plan(make_plan(wanted, source or Source.of_document(doc), force=force), now=now)


def apply_plan(plan: Plan, *, now: datetime) -> Applied:
    """Apply a plan: exactly what it lists, provided the database still matches it.

    Raises PlanChanged (nothing applied) when the catalog changed since the plan was made. An account's limits
    or an alias that changed between the commit of the catalog and their own write are reported in
    ``Applied.conflicts`` and left alone.
    """
    later: list[ObjectPlan] = []
    with transaction.atomic(durable=True):
        if make_plan([o.wanted for o in plan.objects], plan.source, force=plan.force) != plan:
            raise PlanChanged(
                "the database changed since the plan was made; nothing applied: review it again"
            )
        for item in plan.objects:
            if item.wanted.model is PolicyAlias:
                if item.writes:
                    later.append(item)
            elif item.pk is None:
                _create(item, plan.source, now)
            else:
                catalog = [f for f in item.writes if not _is_limit(item, f)]
                if catalog:
                    _update(item, catalog, plan.source, now)
                if len(catalog) < len(item.writes):
                    later.append(item)
    conflicts = []
    for item in later:
        try:
            if item.wanted.model is PolicyAlias:
                _move_alias(item, plan.source, now)
            else:
                _set_limits(item, plan.source, now)
        except DomainError as exc:
            conflicts.append(f"{item.wanted.kind} {item.wanted.label}: {exc.detail}")
    forget_account_cache()
    return Applied(plan, tuple(conflicts))


def _is_limit(item: ObjectPlan, f: FieldPlan) -> bool:
    return item.wanted.model is CapacityAccount and f.name in LIMIT_FIELDS


def _reason(source: Source, fields: Iterable[FieldPlan]) -> str:
    overridden = [f.key for f in fields if f.outcome == Outcome.OVERRIDE]
    if not overridden:
        return source.reason
    return f"{source.reason}; --force overrides the value people set for {', '.join(overridden)}"


def _target(field: Any, natural: Any) -> models.Model | None:
    model = related_model(field)
    return None if natural is None else model._default_manager.get(**{NATURAL_KEYS[model]: natural})


def _targets(field: Any, naturals: list[Any]) -> list[models.Model]:
    model = related_model(field)
    return list(model._default_manager.filter(**{f"{NATURAL_KEYS[model]}__in": naturals}))


def _create(item: ObjectPlan, source: Source, now: datetime) -> None:
    model = item.wanted.model
    values: dict[str, Any] = {}
    many: dict[str, list[models.Model]] = {}
    wanted = {**item.wanted.lookup, **{f.name: f.new for f in item.fields}, **item.wanted.on_create}
    for name, value in wanted.items():
        field = model._meta.get_field(name)
        if field.many_to_many:
            many[name] = _targets(field, value)
        else:
            values[name] = _target(field, value) if field.is_relation else value
    obj = model._default_manager.create(**values)
    for name, targets in many.items():
        getattr(obj, name).set(targets)
    record_change(
        actor=source.actor,
        action=f"{model._meta.model_name}.add",
        target=obj,
        before=None,
        after=snapshot(obj),
        reason=source.reason,
    )
    _remember(obj, item.fields, source, now)


def _update(item: ObjectPlan, fields: list[FieldPlan], source: Source, now: datetime) -> None:
    model = item.wanted.model
    if model is Price and item.pk is not None and Reservation.objects.filter(price_id=item.pk).exists():
        raise ProvisioningError(
            f"prices[{item.wanted.label}]",
            "admissions used this price: it cannot be changed; add a new price effective from now",
        )
    obj = model._default_manager.get(pk=item.pk)
    names = tuple(f.name for f in fields)
    before = snapshot(obj, names)
    plain = []
    for f in fields:
        field = model._meta.get_field(f.name)
        if field.many_to_many:
            getattr(obj, f.name).set(_targets(field, f.new))
        else:
            setattr(obj, f.name, _target(field, f.new) if field.is_relation else f.new)
            plain.append(f.name)
    if plain:
        obj.save(update_fields=plain)
    record_change(
        actor=source.actor,
        action=f"{model._meta.model_name}.change",
        target=obj,
        before=before,
        after=snapshot(obj, names),
        reason=_reason(source, fields),
    )
    _remember(obj, fields, source, now)


def _set_limits(item: ObjectPlan, source: Source, now: datetime) -> None:
    """The account's new limits through the ledger, compare-and-swap on the limits the plan saw. Active
    temporary increases stay on top of the file's values (their end takes them off again)."""
    assert item.pk is not None
    writes = {f.name: f for f in item.writes if f.name in LIMIT_FIELDS}
    new = [item.observed[name] for name in LIMIT_FIELDS]
    for i, name in enumerate(LIMIT_FIELDS):
        if name in writes:
            value = writes[name].new
            new[i] = None if value is None else value + item.offsets.get(name, 0)
    set_account_limits(
        account_id=item.pk,
        input_limit=new[0],
        output_limit=new[1],
        concurrency_limit=new[2],
        spend_limit=new[3],
        expected=tuple(item.observed[name] for name in LIMIT_FIELDS),
        reason=_reason(source, writes.values()),
        actor=source.actor,
    )
    with transaction.atomic(durable=True):
        _remember(CapacityAccount.objects.get(pk=item.pk), writes.values(), source, now)


def _move_alias(item: ObjectPlan, source: Source, now: datetime) -> None:
    """Create the alias, or move it by compare-and-swap on the version the plan saw."""
    (version,) = item.writes
    name = item.wanted.lookup["name"]
    expected = None
    if item.pk is not None:
        expected = PolicyVersion.objects.get(revision=item.observed["version"]).pk
    activate(
        alias_name=name,
        version_id=PolicyVersion.objects.get(revision=version.new).pk,
        expected_version_id=expected,
        reason=_reason(source, item.writes),
        actor=source.actor,
    )
    with transaction.atomic(durable=True):
        _remember(PolicyAlias.objects.get(name=name), item.writes, source, now)


def _remember(obj: models.Model, fields: Iterable[FieldPlan], source: Source, now: datetime) -> None:
    """Record what the file wrote on each field, for the next plan to compare against."""
    ProvisionedValue.objects.bulk_create(
        [
            ProvisionedValue(
                target_type=obj._meta.label_lower,
                target_id=str(obj.pk),
                field=f.name,
                value=f.new,
                source=source.actor.username,
                applied_at=now,
            )
            for f in fields
        ],
        update_conflicts=True,
        unique_fields=["target_type", "target_id", "field"],
        update_fields=["value", "source", "applied_at"],
    )
