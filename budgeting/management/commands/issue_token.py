"""``manage.py issue_token``: issue a service client's API token (named, optionally expiring, retiring the
current ones now or later), or revoke tokens by prefix. Every change lands in the change log."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from budgeting.catalog import tokens
from budgeting.catalog.changes import Actor
from budgeting.catalog.errors import DomainError
from budgeting.catalog.models import ApiToken, ServiceClient


def moment(value: str) -> datetime:
    """An ISO 8601 date or time (UTC unless it says otherwise), or ``now``."""
    if value == "now":
        return timezone.now()
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise CommandError(f"{value!r} is not an ISO 8601 time (2026-12-31T18:00) or 'now'") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


class Command(BaseCommand):
    help = (
        "Issue an API token for a service client (printed once, stored hashed), optionally named and "
        "expiring, retiring the client's current tokens now or at a chosen time; or revoke tokens by prefix."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("client", help="service client name")
        parser.add_argument("--name", default="", help="what the token is for, e.g. 'gateway eu-1'")
        parser.add_argument("--expires", type=moment, help="the new token stops working at this time (UTC)")
        parser.add_argument(
            "--retire-current",
            type=moment,
            metavar="WHEN",
            help="the client's current tokens stop working at WHEN ('now' revokes them)",
        )
        parser.add_argument("--revoke", metavar="PREFIX", help="revoke the client's tokens with this prefix")
        parser.add_argument("--reason", default="from the command line", help="for the change log")
        parser.add_argument("--by", default="cli", help="who is making the change (for the change log)")

    def handle(self, *args: Any, **options: Any) -> None:
        client = ServiceClient.objects.filter(name=options["client"]).first()
        if client is None:
            raise CommandError(f"no service client named {options['client']!r}")
        actor = Actor(None, options["by"])
        try:
            if options["revoke"]:
                self.revoke(client, options["revoke"], options["reason"], actor)
                return
            issued = tokens.issue_token(
                client_id=client.pk,
                name=options["name"],
                expires_at=options["expires"],
                retire_current_at=options["retire_current"],
                reason=options["reason"],
                actor=actor,
                now=timezone.now(),
            )
        except DomainError as exc:
            raise CommandError(f"{exc.code}: {exc.detail}") from None
        if issued.revoked:
            self.stdout.write(f"revoked {issued.revoked} current token(s)")
        if issued.retiring:
            when = options["retire_current"]
            self.stdout.write(f"{issued.retiring} current token(s) stop working at {when:%Y-%m-%d %H:%M} UTC")
        self.stdout.write(f"token for {client.name} (shown once, store it now): {issued.raw}")

    def revoke(self, client: ServiceClient, prefix: str, reason: str, actor: Actor) -> None:
        matching = ApiToken.objects.filter(client=client, prefix__startswith=prefix, revoked_at__isnull=True)
        revoked = sum(
            tokens.revoke_token(token_id=pk, reason=reason, actor=actor, now=timezone.now())
            for pk in matching.values_list("pk", flat=True)
        )
        if not revoked:
            raise CommandError("no active token with that prefix")
        self.stdout.write(f"revoked {revoked} token(s)")
