"""``manage.py grant_role USER ROLE``: give a person a back-office role (finance, platform or analyst)."""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import User
from django.core.management.base import BaseCommand, CommandError, CommandParser

from budgeting.backoffice.roles import ROLES, grant_role, roles_of
from budgeting.catalog.changes import Actor


class RoleCommand(BaseCommand):
    """The arguments ``grant_role`` and ``revoke_role`` share: a username, a role, and the change log's
    reason and author."""

    verb = "granted"

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("username")
        parser.add_argument("role", choices=sorted(ROLES))
        parser.add_argument(
            "--reason", default=f"{self.verb} from the command line", help="for the change log"
        )
        parser.add_argument("--by", default="cli", help="who is making the change (for the change log)")

    def user(self, username: str) -> User:
        user = User.objects.filter(username=username).first()
        if user is None:
            raise CommandError(f"no user {username!r}")
        return user


class Command(RoleCommand):
    help = (
        "Give a user a back-office role: finance (limits, increases, corrections, prices, billing imports, "
        "alert thresholds), platform (catalog, policies, service clients and tokens, login lockouts) or "
        "analyst (reports; balances and limits read-only). The user becomes staff; --create makes it first "
        "(then set its password with `manage.py changepassword USER`)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("--create", action="store_true", help="create the user if it does not exist")

    def handle(self, *args: Any, **options: Any) -> None:
        username, role = options["username"], options["role"]
        if options["create"] and not User.objects.filter(username=username).exists():
            User.objects.create_user(username)  # no usable password until changepassword sets one
            self.stdout.write(f"created {username}; set a password: manage.py changepassword {username}")
        try:
            user = self.user(username)
        except CommandError:
            raise CommandError(f"no user {username!r} (add --create to create it)") from None
        changed = grant_role(user, role, actor=Actor(None, options["by"]), reason=options["reason"])
        state = "now has" if changed else "already had"
        self.stdout.write(f"{username} {state} the {role} role (roles: {', '.join(roles_of(user))})")
