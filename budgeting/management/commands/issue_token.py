from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction
from django.utils import timezone

from budgeting.catalog.models import ApiToken, ServiceClient, hash_token, new_token_value


class Command(BaseCommand):
    help = "Issue an API token for a service client (printed once, stored hashed), or revoke one by prefix."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("client", help="service client name")
        parser.add_argument(
            "--revoke", metavar="PREFIX", help="revoke the client's token(s) with this prefix"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        client = ServiceClient.objects.filter(name=options["client"]).first()
        if client is None:
            raise CommandError(f"no service client named {options['client']!r}")
        if options["revoke"]:
            with transaction.atomic(durable=True):
                count = ApiToken.objects.filter(
                    client=client, prefix__startswith=options["revoke"], revoked_at__isnull=True
                ).update(revoked_at=timezone.now())
            if not count:
                raise CommandError("no active token with that prefix")
            self.stdout.write(f"revoked {count} token(s)")
            return
        raw = new_token_value()
        ApiToken.objects.create(client=client, token_hash=hash_token(raw), prefix=raw[:8])
        self.stdout.write(f"token for {client.name} (shown once, store it now): {raw}")
