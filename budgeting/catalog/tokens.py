"""Service clients' API tokens: issue (named, optionally expiring), rotation that retires the current tokens
now or at a chosen time, revocation, and when each was last used.

"Last used" never costs the API a database statement (the admission path is counted to a few): the API notes
it in Redis, at most once a minute per token and process, and a beat task copies it to the tokens' rows.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from typing import cast

import redis
from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.db.models.functions import Coalesce, Least

from budgeting.catalog.changes import Actor, record_change, require_reason
from budgeting.catalog.errors import InvalidChange, NotFound
from budgeting.catalog.models import ApiToken, ServiceClient, hash_token, new_token_value

logger = logging.getLogger(__name__)

LAST_USED_KEY = "tb:token-last-used"
# The copy task renames the hash before reading it, so uses noted meanwhile land in a fresh one.
LAST_USED_COPYING = "tb:token-last-used:copying"
NOTE_EVERY_SECONDS = 60.0


@dataclass(frozen=True)
class IssuedToken:
    """A new token: ``raw`` is shown once and never stored. ``revoked``: current tokens revoked now;
    ``retiring``: current tokens that will stop working at the chosen time."""

    token: ApiToken
    raw: str
    revoked: int
    retiring: int


def issue_token(
    *,
    client_id: int,
    reason: str,
    actor: Actor,
    now: datetime,
    name: str = "",
    expires_at: datetime | None = None,
    retire_current_at: datetime | None = None,
) -> IssuedToken:
    """Issue a new API token for a service client. Its current tokens stay valid (``retire_current_at``
    None), are revoked now (a time not after ``now``), or stop working at the chosen time, so gateways can
    switch over without downtime. Raises NotFound, InvalidChange (no reason, an expiry in the past)."""
    reason = require_reason(reason)
    if expires_at is not None and expires_at <= now:
        raise InvalidChange("the new token's expiry must be in the future")
    with transaction.atomic(durable=True):
        client = ServiceClient.objects.filter(pk=client_id).first()
        if client is None:
            raise NotFound("no such service client")
        current = ApiToken.objects.filter(client=client, revoked_at__isnull=True)
        revoked = retiring = 0
        if retire_current_at is not None and retire_current_at <= now:
            revoked = current.update(revoked_at=now)
        elif retire_current_at is not None:
            # An earlier expiry already set on a token is kept: retiring never extends a token's life.
            retiring = current.filter(Q(expires_at__isnull=True) | Q(expires_at__gt=now)).update(
                expires_at=Least(Coalesce("expires_at", retire_current_at), retire_current_at)
            )
        raw = new_token_value()
        token = ApiToken.objects.create(
            client=client, name=name, token_hash=hash_token(raw), prefix=raw[:8], expires_at=expires_at
        )
        after: dict[str, object] = {"newTokenPrefix": token.prefix, "revokedTokens": revoked}
        if name:
            after["name"] = name
        if expires_at is not None:
            after["expiresAt"] = expires_at.isoformat()
        if retiring and retire_current_at is not None:
            after.update(retiringTokens=retiring, retireAt=retire_current_at.isoformat())
        record_change(
            actor=actor, action="client.token_rotate", target=client, before=None, after=after, reason=reason
        )
        return IssuedToken(token=token, raw=raw, revoked=revoked, retiring=retiring)


def revoke_token(*, token_id: int, reason: str, actor: Actor, now: datetime) -> bool:
    """Revoke one API token; returns False when it was already revoked."""
    reason = require_reason(reason)
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


@cache
def _redis() -> redis.Redis:
    # Short timeouts: noting a use must never hold up the request that made it.
    return redis.Redis.from_url(str(settings.REDIS_URL), socket_timeout=0.25, socket_connect_timeout=0.25)


_noted: dict[int, float] = {}


def note_use(token_id: int, at: datetime) -> None:
    """Note that the API accepted ``token_id`` at ``at`` (the database clock): in Redis, at most once every
    NOTE_EVERY_SECONDS per token in this process. A Redis failure loses the note, never the request."""
    clock = time.monotonic()
    last = _noted.get(token_id)
    if last is not None and clock - last < NOTE_EVERY_SECONDS:
        return
    _noted[token_id] = clock
    try:
        _redis().hset(LAST_USED_KEY, str(token_id), at.isoformat())
    except redis.RedisError as exc:
        logger.debug("token last-used note lost (Redis): %s", exc)


def copy_last_used() -> int:
    """Copy the last-used times noted in Redis to the tokens' rows (only ever forward); returns the number
    of rows changed. Idempotent: a copy interrupted before it deleted the taken hash is redone next time."""
    client = _redis()
    # A ResponseError here means nothing was noted since the last copy (no such key).
    with contextlib.suppress(redis.ResponseError):
        client.renamenx(LAST_USED_KEY, LAST_USED_COPYING)
    taken = cast(dict[bytes, bytes], client.hgetall(LAST_USED_COPYING))
    noted = {int(token_id): datetime.fromisoformat(at.decode()) for token_id, at in taken.items()}
    changed = 0
    with transaction.atomic(durable=True):
        for token_id, at in sorted(noted.items()):
            changed += (
                ApiToken.objects.filter(pk=token_id)
                .filter(Q(last_used_at__isnull=True) | Q(last_used_at__lt=at))
                .update(last_used_at=at)
            )
    client.delete(LAST_USED_COPYING)
    return changed
