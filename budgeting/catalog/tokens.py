"""Service clients' API tokens: rotation (old ones may stay valid for a switch-over) and revocation."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.db import transaction

from budgeting.catalog.changes import Actor, record_change, require_reason
from budgeting.catalog.errors import NotFound
from budgeting.catalog.models import ApiToken, ServiceClient, hash_token, new_token_value


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
    reason = require_reason(reason)
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
