"""Policy versions and the alias: validation, activation and rollback by compare-and-swap, and diffs.

A policy version is a draft until it is validated; a validated version is immutable. The alias
(``production``) moves only by a compare-and-swap on the version it pointed at when the person confirmed,
so two admins (or an admin and a deploy script) can never overwrite each other's move unknowingly. Callable
from the admin and from management commands alike.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import redis
from django.db import transaction
from django.db.models.functions import Now

from budgeting.admission.count_cache import RedisCountCache
from budgeting.catalog.changes import Actor, record_change, snapshot
from budgeting.catalog.errors import Conflict, InvalidChange, InvalidInput, NotFound
from budgeting.catalog.models import ChangeRecord, PolicyAlias, PolicyState, PolicyVersion
from budgeting.catalog.policy_schema import FieldError, schema_errors
from ladder.policy import PolicyError, parse_policy

logger = logging.getLogger(__name__)

# Count cache keys are ``tc:{tokenizer digest}:{template revision}:{content digest}`` (ladder.counting): no
# part of them names a policy version, so the counts "tied to" a version cannot be told apart from the others.
# A rollback therefore clears every cached count; they are recomputed on the next requests (slower admissions
# for a while, never wrong ones).
COUNT_CACHE_PREFIX = "tc:"


class PolicyInvalid(InvalidInput):
    code = "POLICY_INVALID"
    title = "The policy document is not valid"


class AliasMoved(Conflict):
    code = "POLICY_ALIAS_MOVED"
    title = "The alias no longer points at the version you confirmed"


class NotValidated(Conflict):
    code = "POLICY_NOT_VALIDATED"
    title = "Only a validated policy version can be activated"


class NothingToRollBack(Conflict):
    code = "POLICY_NO_PREVIOUS"
    title = "The alias has no previous version to roll back to"


class AlreadyActive(Conflict):
    code = "POLICY_ALREADY_ACTIVE"
    title = "That version is already active"


def document_errors(document: Any, *, revision: int) -> list[FieldError]:
    """Validate a policy document for the version ``revision``; returns every error found (empty when valid).

    The published schema reports all it finds at once, each with its path; ``parse_policy`` (the source of
    truth) is asked too, and its error is added when no schema error already names that field.
    """
    errors = schema_errors(document)
    try:
        parse_policy(document)
    except PolicyError as exc:
        error = FieldError(exc.path or "(document)", exc.message)
        if not any(_related(error.path, e.path) for e in errors):
            errors.append(error)
    stated = document.get("revision") if isinstance(document, dict) else None
    if type(stated) is int and stated != revision:
        errors.append(FieldError("revision", f"must be {revision}, the revision of this policy version"))
    return errors


def _related(a: str, b: str) -> bool:
    """Whether two field paths name the same field or one contains the other."""
    return a == b or a.startswith((b + ".", b + "[")) or b.startswith((a + ".", a + "["))


def global_cap(document: Any) -> int:
    """The document's ``globalMaxInputTokens`` (documents stored as VALIDATED always have one)."""
    return int(document["globalMaxInputTokens"])


def effective_cap(alias: PolicyAlias) -> int:
    """The global per-request cap admission applies: the version's, lowered by a kept rollback floor."""
    cap = global_cap(alias.version.document)
    return cap if alias.global_cap_floor is None else min(cap, alias.global_cap_floor)


@dataclass(frozen=True)
class CapInForce:
    """The global per-request cap an alias applies, and why: its version's own cap, or the lower cap a
    rollback kept (SPEC §6) until the next activation."""

    alias: str
    revision: int
    cap: int
    version_cap: int
    rolled_back_from: int | None
    rolled_back_at: datetime | None

    @property
    def kept_by_rollback(self) -> bool:
        return self.cap < self.version_cap

    def explain(self) -> str:
        if not self.kept_by_rollback:
            return f"{self.cap:,} tokens: r{self.revision}'s own globalMaxInputTokens."
        origin = f"r{self.rolled_back_from}" if self.rolled_back_from else "the version rolled back from"
        when = f" on {self.rolled_back_at:%Y-%m-%d %H:%M} UTC" if self.rolled_back_at else ""
        return (
            f"{self.cap:,} tokens: the lower cap of {origin}, kept when {self.alias} was rolled back to "
            f"r{self.revision}{when}. r{self.revision}'s own cap is {self.version_cap:,}; the lower one "
            "stays in force until a version is activated."
        )


def cap_in_force(alias: PolicyAlias) -> CapInForce:
    """The cap ``alias`` applies and where it comes from (the rollback that kept it, from the change log)."""
    rollback = (
        ChangeRecord.objects.filter(
            action="policy.rollback", target_type=alias._meta.label_lower, target_id=str(alias.pk)
        )
        .order_by("-at", "-id")
        .first()
    )
    from_revision = None
    if rollback is not None and rollback.before:
        from_revision = (
            PolicyVersion.objects.filter(pk=rollback.before.get("version"))
            .values_list("revision", flat=True)
            .first()
        )
    return CapInForce(
        alias=alias.name,
        revision=alias.version.revision,
        cap=effective_cap(alias),
        version_cap=global_cap(alias.version.document),
        rolled_back_from=from_revision,
        rolled_back_at=rollback.at if rollback else None,
    )


def validate_version(*, version_id: int, reason: str, actor: Actor, now: datetime) -> PolicyVersion:
    """Freeze a draft as VALIDATED after checking its document. Raises PolicyInvalid (with ``errors``),
    Conflict when it is not a draft any more, NotFound."""
    with transaction.atomic(durable=True):
        version = PolicyVersion.objects.filter(pk=version_id).first()
        if version is None:
            raise NotFound("no such policy version")
        errors = document_errors(version.document, revision=version.revision)
        if errors:
            raise PolicyInvalid(
                f"{errors[0].path}: {errors[0].message}",
                errors=[{"path": e.path, "message": e.message} for e in errors],
            )
        # Conditional UPDATE: two people validating at once, or an edit racing the validation, cannot both
        # win.
        if not PolicyVersion.objects.filter(
            pk=version_id, state=PolicyState.DRAFT, document=version.document
        ).update(state=PolicyState.VALIDATED, validated_at=now):
            raise Conflict("the version is no longer the draft you validated", code="POLICY_NOT_DRAFT")
        version.refresh_from_db()
        record_change(
            actor=actor,
            action="policy.validate",
            target=version,
            before={"state": PolicyState.DRAFT},
            after={"state": version.state, "revision": version.revision},
            reason=reason or "validated",
        )
        return version


@dataclass(frozen=True)
class AliasPlan:
    """What moving an alias will change, shown on the confirmation page and checked again by the CAS."""

    alias: str
    from_version_id: int | None
    from_revision: int | None
    to_version_id: int
    to_revision: int
    cap_before: int | None
    cap_after: int
    cap_floor_after: int | None
    clears_caches: bool
    diff: list[DiffLine]


@dataclass(frozen=True)
class AliasChange:
    """The result of a move; ``caches_cleared`` is None when clearing failed (the move itself stands)."""

    plan: AliasPlan
    caches_cleared: int | None


def plan_activation(*, alias_name: str, version_id: int) -> AliasPlan:
    """What activating ``version_id`` on the alias would do. Raises NotFound, NotValidated, AlreadyActive."""
    version = PolicyVersion.objects.filter(pk=version_id).first()
    if version is None:
        raise NotFound("no such policy version")
    if version.state != PolicyState.VALIDATED:
        raise NotValidated(f"r{version.revision} is a draft; validate it first")
    alias = PolicyAlias.objects.select_related("version").filter(name=alias_name).first()
    if alias is not None and alias.version_id == version.pk:
        raise AlreadyActive(f"r{version.revision} is already active as {alias_name}")
    return AliasPlan(
        alias=alias_name,
        from_version_id=alias.version_id if alias else None,
        from_revision=alias.version.revision if alias else None,
        to_version_id=version.pk,
        to_revision=version.revision,
        cap_before=effective_cap(alias) if alias else None,
        cap_after=global_cap(version.document),
        cap_floor_after=None,
        clears_caches=False,
        diff=diff_documents(alias.version.document if alias else None, version.document),
    )


def plan_rollback(*, alias_name: str) -> AliasPlan:
    """What rolling the alias back to its previous version would do. Raises NotFound, NothingToRollBack."""
    alias = PolicyAlias.objects.select_related("version", "previous").filter(name=alias_name).first()
    if alias is None:
        raise NotFound(f"no policy alias {alias_name!r}")
    if alias.previous is None:
        raise NothingToRollBack(f"{alias_name} has no previous version")
    floor = min(global_cap(alias.version.document), global_cap(alias.previous.document))
    return AliasPlan(
        alias=alias_name,
        from_version_id=alias.version_id,
        from_revision=alias.version.revision,
        to_version_id=alias.previous.pk,
        to_revision=alias.previous.revision,
        cap_before=effective_cap(alias),
        cap_after=floor,
        cap_floor_after=floor,
        clears_caches=True,
        diff=diff_documents(alias.version.document, alias.previous.document),
    )


def activate(
    *, alias_name: str, version_id: int, expected_version_id: int | None, reason: str, actor: Actor
) -> AliasChange:
    """Point the alias at a validated version by compare-and-swap on ``expected_version_id`` (None: the alias
    does not exist yet). The version it leaves becomes ``previous`` (the rollback target) and a cap floor kept
    by an earlier rollback is dropped: the new version's own cap applies.

    Raises AliasMoved when the alias is not at ``expected_version_id`` any more, AlreadyActive when it moved
    to ``version_id`` itself, NotValidated, NotFound, InvalidChange (no reason).
    """
    if not reason.strip():
        raise InvalidChange("a reason is required to activate a policy version")
    plan = plan_activation(alias_name=alias_name, version_id=version_id)
    with transaction.atomic(durable=True):
        if expected_version_id is None:
            alias, created = PolicyAlias.objects.get_or_create(
                name=alias_name, defaults={"version_id": version_id}
            )
            if not created:
                raise AliasMoved(f"{alias_name} already exists (at r{alias.version.revision})")
            before = None
        else:
            before_alias = PolicyAlias.objects.filter(name=alias_name).first()
            before = snapshot(before_alias) if before_alias else None
            # A queryset update skips auto_now: the move sets "updated at" itself.
            moved = PolicyAlias.objects.filter(name=alias_name, version_id=expected_version_id).update(
                version_id=version_id,
                previous_id=expected_version_id,
                global_cap_floor=None,
                updated_at=Now(),
            )
            if not moved:
                raise AliasMoved(f"{alias_name} was moved by someone else; review it and confirm again")
            alias = PolicyAlias.objects.get(name=alias_name)
        record_change(
            actor=actor,
            action="policy.activate",
            target=alias,
            before=before,
            after={**snapshot(alias), "revision": plan.to_revision},
            reason=reason,
        )
    return AliasChange(plan=plan, caches_cleared=None)


def rollback(
    *,
    alias_name: str,
    expected_version_id: int,
    reason: str,
    actor: Actor,
    cache: RedisCountCache | None = None,
) -> AliasChange:
    """Move the alias back to its previous version by compare-and-swap, keep the lower of the two global caps
    as the floor, then clear the cached token counts (after the commit; a Redis failure is logged and
    reported as ``caches_cleared=None``, it does not undo the rollback).

    ``previous`` is emptied: a second rollback would re-activate the version just rolled back from, which is
    never what an operator pressing "roll back" twice means. Raises AliasMoved, NothingToRollBack, NotFound,
    InvalidChange.
    """
    if not reason.strip():
        raise InvalidChange("a reason is required to roll back a policy version")
    plan = plan_rollback(alias_name=alias_name)
    if plan.from_version_id != expected_version_id:
        raise AliasMoved(f"{alias_name} was moved by someone else; review it and confirm again")
    with transaction.atomic(durable=True):
        before_alias = PolicyAlias.objects.get(name=alias_name)
        before = snapshot(before_alias)
        moved = PolicyAlias.objects.filter(
            name=alias_name, version_id=expected_version_id, previous_id=plan.to_version_id
        ).update(
            version_id=plan.to_version_id,
            previous_id=None,
            global_cap_floor=plan.cap_floor_after,
            updated_at=Now(),
        )
        if not moved:
            raise AliasMoved(f"{alias_name} was moved by someone else; review it and confirm again")
        alias = PolicyAlias.objects.get(name=alias_name)
        record_change(
            actor=actor,
            action="policy.rollback",
            target=alias,
            before=before,
            after={**snapshot(alias), "revision": plan.to_revision, "countCacheCleared": True},
            reason=reason,
        )
    try:
        cleared: int | None = (cache or RedisCountCache()).clear_prefix(COUNT_CACHE_PREFIX)
    except redis.RedisError:
        logger.exception("policy rollback of %s: clearing the count cache failed", alias_name)
        cleared = None
    return AliasChange(plan=plan, caches_cleared=cleared)


# --- diff ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DiffLine:
    """One changed leaf of two JSON documents: ``kind`` is added, removed or changed."""

    path: str
    kind: str
    old: str
    new: str


def _flatten(value: Any, path: str, out: dict[str, Any]) -> None:
    if isinstance(value, dict) and value:
        for key in sorted(value):
            _flatten(value[key], f"{path}.{key}" if path else str(key), out)
    else:
        out[path or "$"] = value


def diff_documents(old: Any, new: Any) -> list[DiffLine]:
    """The leaves that differ between two JSON documents (None: no document), by path; lists are compared as
    whole values (a ladder is read as one ordered thing, not element by element)."""
    before: dict[str, Any] = {}
    after: dict[str, Any] = {}
    if old is not None:
        _flatten(old, "", before)
    if new is not None:
        _flatten(new, "", after)
    lines = []
    for path in sorted(set(before) | set(after)):
        if path in before and path not in after:
            lines.append(DiffLine(path, "removed", _show(before[path]), ""))
        elif path in after and path not in before:
            lines.append(DiffLine(path, "added", "", _show(after[path])))
        elif before[path] != after[path]:
            lines.append(DiffLine(path, "changed", _show(before[path]), _show(after[path])))
    return lines


def _show(value: Any) -> str:
    """A leaf as a person reads it: counts with thousands separators, anything else as JSON."""
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return json.dumps(value, ensure_ascii=False)
