"""Write path of the admin: account limits, temporary increases, ledger corrections, token rotation, and the
change log every privileged change lands in.

Conventions are the ledger's (``ledger.services``): each use case owns its
``transaction.atomic(durable=True)`` boundary, locks accounts through ``ledger.locks``, writes one ledger
entry per balance change, and updates balances with ``F()`` expressions so a concurrent admission's
conditional UPDATE is never overwritten by stale values from a form.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.contrib.auth.models import AbstractBaseUser, AnonymousUser
from django.core.serializers.json import DjangoJSONEncoder
from django.db import models, transaction
from django.db.models import F
from django.forms.models import model_to_dict

from budgeting.api.problems import Conflict, InvalidInput, NotFound
from budgeting.catalog.models import (
    ApiToken,
    ChangeRecord,
    ServiceClient,
    TemporaryIncrease,
    hash_token,
    new_token_value,
)
from ledger import locks
from ledger.models import CapacityAccount, EntryKind, LedgerEntry

LIMIT_FIELDS = ("input_limit", "output_limit", "concurrency_limit")
BALANCE_FIELDS = ("input_reserved", "output_reserved", "input_consumed", "output_consumed", "in_flight")


class LimitsChanged(Conflict):
    code = "LIMITS_CHANGED"
    title = "The account's limits changed since the page was loaded"


class InvalidChange(InvalidInput):
    code = "INVALID_CHANGE"
    title = "The change is not allowed"


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


def _require_reason(reason: str) -> str:
    reason = reason.strip()
    if not reason:
        raise InvalidChange("a reason is required for every privileged change")
    return reason


# --- limits -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DimensionPreview:
    """One limit dimension before and after an edit. ``None`` limits are unlimited."""

    name: str
    used: int
    old_limit: int | None
    new_limit: int | None

    @property
    def changed(self) -> bool:
        return self.old_limit != self.new_limit

    @property
    def old_available(self) -> int | None:
        return None if self.old_limit is None else self.old_limit - self.used

    @property
    def new_available(self) -> int | None:
        return None if self.new_limit is None else self.new_limit - self.used

    @property
    def below_use(self) -> bool:
        """The new limit is under what is already reserved and consumed: new requests will be refused."""
        return self.new_limit is not None and self.new_limit < self.used


def used(account: CapacityAccount) -> dict[str, int]:
    """Reserved plus consumed (in flight for concurrency) per dimension in the current period."""
    return {
        "input": account.input_reserved + account.input_consumed,
        "output": account.output_reserved + account.output_consumed,
        "concurrency": account.in_flight,
    }


def preview_limits(
    account: CapacityAccount,
    *,
    input_limit: int | None,
    output_limit: int | None,
    concurrency_limit: int | None,
) -> list[DimensionPreview]:
    """What an edit of the limits would do to availability, per dimension (nothing is written)."""
    in_use = used(account)
    return [
        DimensionPreview("input", in_use["input"], account.input_limit, input_limit),
        DimensionPreview("output", in_use["output"], account.output_limit, output_limit),
        DimensionPreview("concurrency", in_use["concurrency"], account.concurrency_limit, concurrency_limit),
    ]


def set_account_limits(
    *,
    account_id: int,
    input_limit: int | None,
    output_limit: int | None,
    concurrency_limit: int | None,
    expected: tuple[int | None, int | None, int | None],
    reason: str,
    actor: Actor,
) -> list[DimensionPreview]:
    """Set an account's limits (lowering below current use is allowed: new holds are then refused).

    ``expected`` are the limits the person saw when confirming; if they changed meanwhile (another admin, a
    temporary increase expiring) nothing is written. Raises LimitsChanged, InvalidChange, NotFound.
    """
    reason = _require_reason(reason)
    if any(v is not None and v < 0 for v in (input_limit, output_limit, concurrency_limit)):
        raise InvalidChange("limits cannot be negative")
    with transaction.atomic(durable=True):
        account = _lock(account_id)
        current = (account.input_limit, account.output_limit, account.concurrency_limit)
        if current != tuple(expected):
            raise LimitsChanged(
                "the limits changed since you looked at them; review the new values and confirm again",
                current=list(current),
            )
        preview = preview_limits(
            account, input_limit=input_limit, output_limit=output_limit, concurrency_limit=concurrency_limit
        )
        if not any(p.changed for p in preview):
            return preview
        before = snapshot(account, LIMIT_FIELDS)
        CapacityAccount.objects.filter(pk=account.pk).update(
            input_limit=input_limit, output_limit=output_limit, concurrency_limit=concurrency_limit
        )
        account.refresh_from_db()
        record_change(
            actor=actor,
            action="account.limits",
            target=account,
            before=before,
            after=snapshot(account, LIMIT_FIELDS),
            reason=reason,
        )
        return preview


def _lock(account_id: int) -> CapacityAccount:
    try:
        return locks.lock_account(account_id)
    except CapacityAccount.DoesNotExist:
        raise NotFound("no such capacity account") from None


# --- temporary increases ------------------------------------------------------------------------------------


def grant_temporary_increase(
    *,
    account_id: int,
    input_tokens: int,
    output_tokens: int,
    concurrency: int,
    expires_at: datetime,
    reason: str,
    actor: Actor,
    now: datetime,
) -> TemporaryIncrease:
    """Raise an account's limits by these amounts until ``expires_at``.

    Raises InvalidChange for an empty or negative increase, an expiry in the past, or an increase of an
    unlimited dimension (there is nothing to raise); NotFound.
    """
    reason = _require_reason(reason)
    amounts = {"input": input_tokens, "output": output_tokens, "concurrency": concurrency}
    if any(v < 0 for v in amounts.values()) or not any(amounts.values()):
        raise InvalidChange(
            "an increase needs a positive amount on at least one dimension, and no negative one"
        )
    if expires_at <= now:
        raise InvalidChange("the expiry must be in the future")
    with transaction.atomic(durable=True):
        account = _lock(account_id)
        limits = {
            "input": account.input_limit,
            "output": account.output_limit,
            "concurrency": account.concurrency_limit,
        }
        unlimited = [name for name, extra in amounts.items() if extra and limits[name] is None]
        if unlimited:
            raise InvalidChange(f"{', '.join(unlimited)} is unlimited on this account; nothing to increase")
        before = snapshot(account, LIMIT_FIELDS)
        CapacityAccount.objects.filter(pk=account.pk).update(
            input_limit=F("input_limit") + input_tokens,
            output_limit=F("output_limit") + output_tokens,
            concurrency_limit=F("concurrency_limit") + concurrency,
        )
        increase = TemporaryIncrease.objects.create(
            account=account,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            concurrency=concurrency,
            starts_at=now,
            expires_at=expires_at,
            reason=reason,
            created_by=actor.username,
        )
        account.refresh_from_db()
        record_change(
            actor=actor,
            action="account.temporary_increase",
            target=account,
            before=before,
            after={
                **snapshot(account, LIMIT_FIELDS),
                "temporaryIncrease": increase.pk,
                "expiresAt": expires_at.isoformat(),
            },
            reason=reason,
        )
        return increase


def end_temporary_increase(*, increase_id: int, reason: str, actor: Actor, now: datetime) -> bool:
    """Take a temporary increase back off its account's limits (expiry or early revocation).

    Returns False when it had already ended (safe to call twice, or from two workers at once). A limit edited
    below the increase meanwhile goes to zero rather than negative.
    """
    reason = _require_reason(reason)
    account_id = TemporaryIncrease.objects.filter(pk=increase_id).values_list("account_id", flat=True).first()
    if account_id is None:
        raise NotFound("no such temporary increase")
    with transaction.atomic(durable=True):
        # Lock order: the account, then the increase row (by a conditional UPDATE), as in the grant.
        account = _lock(account_id)
        ended = TemporaryIncrease.objects.filter(pk=increase_id, ended_at__isnull=True).update(
            ended_at=now, end_reason=reason[:300]
        )
        if not ended:
            return False
        increase = TemporaryIncrease.objects.get(pk=increase_id)
        before = snapshot(account, LIMIT_FIELDS)

        def lowered(limit: int | None, extra: int) -> int | None:
            return None if limit is None else max(limit - extra, 0)

        CapacityAccount.objects.filter(pk=account.pk).update(
            input_limit=lowered(account.input_limit, increase.input_tokens),
            output_limit=lowered(account.output_limit, increase.output_tokens),
            concurrency_limit=lowered(account.concurrency_limit, increase.concurrency),
        )
        account.refresh_from_db()
        record_change(
            actor=actor,
            action="account.temporary_increase_end",
            target=account,
            before=before,
            after={**snapshot(account, LIMIT_FIELDS), "temporaryIncrease": increase.pk},
            reason=reason,
        )
        return True


def expire_temporary_increases(*, now: datetime) -> int:
    """End every temporary increase whose expiry has passed; returns how many this call ended.

    Meant for a Celery beat task: idempotent and safe to run twice at once (the conditional UPDATE in
    ``end_temporary_increase`` lets exactly one caller end each increase).
    """
    due = TemporaryIncrease.objects.filter(ended_at__isnull=True, expires_at__lte=now).values_list(
        "pk", flat=True
    )
    return sum(
        end_temporary_increase(increase_id=pk, reason="expired", actor=SYSTEM, now=now) for pk in list(due)
    )


# --- ledger corrections -------------------------------------------------------------------------------------


def post_correction(
    *, account_id: int, input_consumed: int, output_consumed: int, reason: str, actor: Actor
) -> LedgerEntry:
    """Post a compensating correction of consumed tokens on an account: a new CORRECTION entry, and the
    balance moved by the same amounts (balances stay the sum of their entries).

    Only consumed balances can be corrected: reserved balances and in-flight counts belong to live
    reservations and are settled through their lifecycle. Raises InvalidChange (nothing to post, no reason,
    a balance would go negative), NotFound.
    """
    reason = _require_reason(reason)
    if not input_consumed and not output_consumed:
        raise InvalidChange("a correction must change input or output consumed")
    with transaction.atomic(durable=True):
        account = _lock(account_id)
        if account.input_consumed + input_consumed < 0 or account.output_consumed + output_consumed < 0:
            raise InvalidChange(
                f"the correction would make a consumed balance negative (input {account.input_consumed}, "
                f"output {account.output_consumed})"
            )
        before = snapshot(account, BALANCE_FIELDS)
        CapacityAccount.objects.filter(pk=account.pk).update(
            input_consumed=F("input_consumed") + input_consumed,
            output_consumed=F("output_consumed") + output_consumed,
        )
        entry = LedgerEntry.objects.create(
            account=account,
            kind=EntryKind.CORRECTION,
            input_consumed=input_consumed,
            output_consumed=output_consumed,
            period_start=account.period_start,
            reason=reason[:300],
            created_by=actor.username,
        )
        account.refresh_from_db()
        record_change(
            actor=actor,
            action="ledger.correction",
            target=account,
            before=before,
            after={**snapshot(account, BALANCE_FIELDS), "ledgerEntry": entry.pk},
            reason=reason,
        )
        return entry


# --- service client tokens ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class IssuedToken:
    """A new token: ``raw`` is shown once and never stored."""

    token: ApiToken
    raw: str
    revoked: int


def rotate_token(
    *, client_id: int, revoke_current: bool, reason: str, actor: Actor, now: datetime
) -> IssuedToken:
    """Issue a new API token for a service client, revoking its current tokens now or leaving them for a
    later revocation (so gateways can switch without downtime). Raises NotFound, InvalidChange."""
    reason = _require_reason(reason)
    with transaction.atomic(durable=True):
        client = ServiceClient.objects.filter(pk=client_id).first()
        if client is None:
            raise NotFound("no such service client")
        revoked = 0
        if revoke_current:
            revoked = ApiToken.objects.filter(client=client, revoked_at__isnull=True).update(revoked_at=now)
        raw = new_token_value()
        token = ApiToken.objects.create(client=client, token_hash=hash_token(raw), prefix=raw[:8])
        record_change(
            actor=actor,
            action="client.token_rotate",
            target=client,
            before=None,
            after={"newTokenPrefix": token.prefix, "revokedTokens": revoked},
            reason=reason,
        )
        return IssuedToken(token=token, raw=raw, revoked=revoked)


def revoke_token(*, token_id: int, reason: str, actor: Actor, now: datetime) -> bool:
    """Revoke one API token; returns False when it was already revoked."""
    reason = _require_reason(reason)
    with transaction.atomic(durable=True):
        token = ApiToken.objects.select_related("client").filter(pk=token_id).first()
        if token is None:
            raise NotFound("no such token")
        if not ApiToken.objects.filter(pk=token_id, revoked_at__isnull=True).update(revoked_at=now):
            return False
        record_change(
            actor=actor,
            action="client.token_revoke",
            target=token.client,
            before={"tokenPrefix": token.prefix, "revoked": False},
            after={"tokenPrefix": token.prefix, "revoked": True},
            reason=reason,
        )
        return True
