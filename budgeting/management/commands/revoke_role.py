"""``manage.py revoke_role USER ROLE``: take a back-office role from a person."""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError

from budgeting.backoffice.roles import revoke_role, roles_of
from budgeting.catalog.changes import Actor
from budgeting.management.commands.grant_role import RoleCommand


class Command(RoleCommand):
    help = (
        "Take a back-office role (finance, platform, analyst) from a user. A user left with no role (and not "
        "a superuser) loses staff status and can no longer sign in to the admin."
    )
    verb = "revoked"

    def handle(self, *args: Any, **options: Any) -> None:
        username, role = options["username"], options["role"]
        user = self.user(username)
        if not revoke_role(user, role, actor=Actor(None, options["by"]), reason=options["reason"]):
            raise CommandError(f"{username} does not have the {role} role")
        left = ", ".join(roles_of(user)) or "none"
        staff = "" if user.is_staff else "; no longer staff"
        self.stdout.write(f"{username} no longer has the {role} role (roles left: {left}{staff})")
