"""Bearer-token authentication for service clients (gateways). Tokens are stored as sha256 hashes."""

from __future__ import annotations

from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.exceptions import AuthenticationFailed
from rest_framework.request import Request

from budgeting.catalog import snapshot
from budgeting.catalog.models import ServiceClient, hash_token
from budgeting.catalog.snapshot import Caller


class ServiceTokenAuthentication(BaseAuthentication):
    keyword = b"bearer"

    def authenticate(self, request: Request) -> tuple[ServiceClient, Caller] | None:
        """The client and its ``Caller`` (tenants, catalog snapshot, database clock): one statement, the
        catalog version check, when the catalog has not changed since this process last read it."""
        header = get_authorization_header(request).split()
        if not header or header[0].lower() != self.keyword:
            return None
        if len(header) != 2:
            raise AuthenticationFailed("Authorization: Bearer <token>")
        try:
            raw = header[1].decode("ascii")
        except UnicodeDecodeError:
            raise AuthenticationFailed("token is not ASCII") from None
        caller = caller_for_token(raw)
        if caller is None:
            raise AuthenticationFailed("unknown or revoked token")
        return caller.client, caller

    def authenticate_header(self, request: Request) -> str:
        return 'Bearer realm="api"'


def caller_for_token(raw: str, *, checked: bool = True) -> Caller | None:
    """The caller a bearer token stands for (None: unknown, revoked or expired), with the catalog snapshot and
    the database clock: one statement, the catalog version check, when the catalog has not changed since this
    process last read it. Unchecked (``checked=False``, for a call whose first statement compares the catalog
    version: ``Caller.checked_version``): no statement, from the snapshot this process last found current,
    when it has one whose token is not about to expire; else as checked."""
    token_hash = hash_token(raw)
    if not checked:
        found = snapshot.unchecked()
        caller = None if found is None else found[0].caller(token_hash, found[1], checked=False)
        if caller is not None:
            return caller
    catalog, db_now = snapshot.current()
    return catalog.caller(token_hash, db_now)
