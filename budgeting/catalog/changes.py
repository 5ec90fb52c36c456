"""The change log: every change to limits, policies or the catalog, by a person, a command or a file, is
recorded here, in the transaction that makes it (append-only)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from django.contrib.auth.models import AbstractBaseUser, AnonymousUser
from django.core.serializers.json import DjangoJSONEncoder
from django.db import models
from django.forms.models import model_to_dict

from budgeting.catalog.errors import InvalidChange
from budgeting.catalog.models import ChangeRecord


@dataclass(frozen=True)
class Actor:
    """Who makes a change: a signed-in user, or the system (scheduled expiry)."""

    user_id: int | None
    username: str

    @classmethod
    def of(cls, user: AbstractBaseUser | AnonymousUser) -> Actor:
        return cls(user_id=user.pk, username=user.get_username())


SYSTEM = Actor(user_id=None, username="system")


def snapshot(obj: models.Model, fields: tuple[str, ...] | None = None) -> dict[str, Any]:
    """A JSON-safe copy of a model's field values (dates as ISO strings, decimals as strings, related
    objects as their primary keys)."""
    data = model_to_dict(obj, fields=list(fields) if fields else None)
    for name, value in data.items():
        if isinstance(value, list | tuple):
            data[name] = sorted(v.pk if isinstance(v, models.Model) else v for v in value)
    return dict(json.loads(json.dumps(data, cls=DjangoJSONEncoder)))


def record_change(
    *,
    actor: Actor,
    action: str,
    target: models.Model,
    before: dict[str, Any] | None,
    after: dict[str, Any] | None,
    reason: str,
) -> ChangeRecord:
    """Append one entry to the change log. Call it inside the transaction that makes the change."""
    return ChangeRecord.objects.create(
        actor_id=actor.user_id,
        actor_username=actor.username,
        action=action,
        target_type=target._meta.label_lower,
        target_id=str(target.pk),
        target_repr=str(target)[:200],
        before=before,
        after=after,
        reason=reason,
    )


def require_reason(reason: str) -> str:
    reason = reason.strip()
    if not reason:
        raise InvalidChange("a reason is required for every privileged change")
    return reason
