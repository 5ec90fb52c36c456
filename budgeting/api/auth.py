"""Bearer-token authentication for service clients (gateways). Tokens are stored as sha256 hashes."""

from __future__ import annotations

from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.exceptions import AuthenticationFailed
from rest_framework.request import Request

from budgeting.catalog.models import ApiToken, ServiceClient, hash_token


class ServiceTokenAuthentication(BaseAuthentication):
    keyword = b"bearer"

    def authenticate(self, request: Request) -> tuple[ServiceClient, ApiToken] | None:
        header = get_authorization_header(request).split()
        if not header or header[0].lower() != self.keyword:
            return None
        if len(header) != 2:
            raise AuthenticationFailed("Authorization: Bearer <token>")
        try:
            raw = header[1].decode("ascii")
        except UnicodeDecodeError:
            raise AuthenticationFailed("token is not ASCII") from None
        token = (
            ApiToken.objects.select_related("client")
            .filter(token_hash=hash_token(raw), revoked_at__isnull=True, client__is_active=True)
            .first()
        )
        if token is None:
            raise AuthenticationFailed("unknown or revoked token")
        return token.client, token

    def authenticate_header(self, request: Request) -> str:
        return 'Bearer realm="api"'
