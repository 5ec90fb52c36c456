"""People and sign-in: `grant_role` / `revoke_role` (the change log keeps each), and admin sign-in lockouts
by username and by address after repeated failures (logged, shown to platform admins, lifted by them)."""

from __future__ import annotations

from io import StringIO

import pytest
from axes.models import AccessAttempt
from django.contrib.auth.models import User
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client
from django.urls import reverse

from budgeting.catalog.models import ChangeRecord
from tests.admin.conftest import PASSWORD, login

pytestmark = pytest.mark.django_db
LOGIN = reverse("admin:login")


def command(name: str, *args: str) -> str:
    out = StringIO()
    call_command(name, *args, stdout=out)
    return out.getvalue()


def test_grant_and_revoke_roles_from_the_command_line(users):
    out = command("grant_role", "alice", "analyst", "--create")
    assert "created alice" in out and "alice now has the analyst role (roles: analyst)" in out
    alice = User.objects.get(username="alice")
    assert alice.is_staff and not alice.has_usable_password()
    assert "already had" in command("grant_role", "alice", "analyst")
    assert "roles: analyst, finance" in command("grant_role", "alice", "finance", "--reason", "month end")
    assert User.objects.get(username="alice").has_perm("ledger.change_capacityaccount")
    out = command("revoke_role", "alice", "finance")
    assert "roles left: analyst" in out and "no longer staff" not in out
    out = command("revoke_role", "alice", "analyst")
    assert "roles left: none; no longer staff" in out
    assert not User.objects.get(username="alice").is_staff
    records = ChangeRecord.objects.filter(target_type="auth.user", target_id=str(alice.pk)).order_by("id")
    assert [r.action for r in records] == ["user.grant_role"] * 2 + ["user.revoke_role"] * 2
    assert records[1].reason == "month end" and records[1].after == {
        "roles": ["analyst", "finance"],
        "staff": True,
    }
    with pytest.raises(CommandError, match="no user 'bob'"):
        command("grant_role", "bob", "platform")
    with pytest.raises(CommandError, match="does not have the platform role"):
        command("revoke_role", "alice", "platform")
    with pytest.raises(CommandError):
        command("grant_role", "alice", "owner")


def test_an_analyst_sees_balances_and_limits_but_cannot_change_them(users, cat):
    analyst = login("analyst")
    account = cat.tenant.accounts.get()
    page = analyst.get(reverse("admin:ledger_capacityaccount_change", args=[account.pk])).content.decode()
    assert "1,000,000" in page or "1000000" in page
    assert "Edit limits" not in page
    limits = reverse("admin:ledger_capacityaccount_limits", args=[account.pk])
    assert analyst.post(limits, {"reason": "x", "step": "confirm", "input_limit": 1}).status_code == 403
    assert analyst.get(reverse("admin:ledger_capacityaccount_changelist")).status_code == 200


def attempt(client: Client, username: str, password: str = "wrong", address: str = "10.1.2.3") -> int:
    response = client.post(
        LOGIN, {"username": username, "password": password, "next": "/admin/"}, REMOTE_ADDR=address
    )
    return response.status_code


def test_repeated_failures_lock_out_the_username_then_platform_lifts_it(users, settings, caplog):
    settings.AXES_FAILURE_LIMIT = 3
    browser = Client()
    assert [attempt(browser, "finance") for _ in range(2)] == [200, 200]  # the form again, with an error
    assert attempt(browser, "finance") == 429
    locked = browser.post(LOGIN, {"username": "finance", "password": PASSWORD}, REMOTE_ADDR="10.9.9.9")
    assert locked.status_code == 429  # the right password from another address: the username is locked
    assert "Signing in is locked for now" in locked.content.decode()
    assert any("admin sign-in locked out" in r.getMessage() for r in caplog.records)
    lockouts = reverse("admin:axes_accessattempt_changelist")
    assert "finance" in login("platform").get(lockouts).content.decode()
    assert login("analyst").get(lockouts).status_code == 403
    rows = list(AccessAttempt.objects.filter(username="finance").values_list("pk", flat=True))
    lift = {"action": "lift", "_selected_action": rows, "reason": "forgot the password"}
    assert login("platform").post(lockouts, lift).status_code == 302
    assert not AccessAttempt.objects.filter(username="finance").exists()
    signed_in = Client().post(LOGIN, {"username": "finance", "password": PASSWORD}, REMOTE_ADDR="10.9.9.9")
    assert signed_in.status_code == 302


def test_repeated_failures_from_one_address_lock_out_the_address(users, settings):
    settings.AXES_FAILURE_LIMIT = 3
    guesser = Client()
    assert [attempt(guesser, name, address="10.6.6.6") for name in ("a", "b", "c")] == [200, 200, 429]
    assert attempt(Client(), "platform", PASSWORD, address="10.6.6.6") == 429
    assert attempt(Client(), "platform", PASSWORD, address="10.7.7.7") == 302
