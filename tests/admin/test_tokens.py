"""API tokens: a name, created and last-used dates, an optional expiry honoured at request time (against the
database clock the catalog snapshot was checked with), rotation that retires the old tokens at a chosen time,
and "last used" recorded without a database write on the request."""

from __future__ import annotations

from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import call_command
from django.db import connection
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from budgeting.catalog import snapshot, tokens
from budgeting.catalog.changes import Actor
from budgeting.catalog.models import ApiToken, ChangeRecord, hash_token
from tests.admin.conftest import login
from tests.dbwork import count_db_work
from tests.factories import ServiceClientFactory, issue_token

pytestmark = pytest.mark.django_db
RESERVATION = "/api/v1/reservations/00000000-0000-0000-0000-000000000000"
BOB = Actor(None, "bob")


def status(raw: str) -> int:
    return Client().get(RESERVATION, HTTP_AUTHORIZATION=f"Bearer {raw}").status_code


def catalog_version() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT version FROM budgeting_catalogversion WHERE id = 1")
        row = cursor.fetchone()
    return row[0] if row else 0


@pytest.fixture
def last_used(redis_db):
    """An empty Redis record of token uses, and a process that has noted none yet."""
    redis_db.delete(tokens.LAST_USED_KEY, tokens.LAST_USED_COPYING)
    tokens._noted.clear()
    yield redis_db
    redis_db.delete(tokens.LAST_USED_KEY, tokens.LAST_USED_COPYING)
    tokens._noted.clear()


def test_an_expiry_is_honoured_at_request_time_against_the_database_clock(cat):
    client = ServiceClientFactory(tenants=[cat.tenant])
    raw = issue_token(client, "tb_expiring_token_aaaaaaaaaaaaaaaa")
    assert status(raw) == 404  # accepted (the reservation does not exist)
    token = ApiToken.objects.get(client=client)
    ApiToken.objects.filter(pk=token.pk).update(expires_at=timezone.now() + timedelta(hours=1))
    catalog, db_now = snapshot.current()
    assert catalog.caller(hash_token(raw), db_now) is not None
    # No write happens when an expiry passes: the snapshot keeps the token and the check uses the clock.
    assert catalog.caller(hash_token(raw), db_now + timedelta(hours=1)) is None
    assert catalog.caller(hash_token(raw), db_now + timedelta(minutes=59)) is not None
    ApiToken.objects.filter(pk=token.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert status(raw) == 401


def test_setting_an_expiry_moves_the_catalog_version_and_a_last_used_date_does_not(cat):
    client = ServiceClientFactory(tenants=[cat.tenant])
    issue_token(client, "tb_version_token_aaaaaaaaaaaaaaaaa")
    token = ApiToken.objects.get(client=client)
    before = catalog_version()
    ApiToken.objects.filter(pk=token.pk).update(last_used_at=timezone.now(), name="renamed")
    assert catalog_version() == before
    ApiToken.objects.filter(pk=token.pk).update(expires_at=timezone.now() + timedelta(days=1))
    assert catalog_version() > before


def test_last_used_is_noted_in_redis_without_a_database_write_then_copied(cat, last_used):
    client = ServiceClientFactory(tenants=[cat.tenant])
    raw = issue_token(client, "tb_last_used_token_aaaaaaaaaaaaaa")
    token = ApiToken.objects.get(client=client)
    with count_db_work() as work:
        assert status(raw) == 404
    writes = [sql for sql in work.statements if sql.lstrip().upper().startswith(("INSERT", "UPDATE"))]
    assert not writes, work.summary()
    assert last_used.hexists(tokens.LAST_USED_KEY, str(token.pk))
    assert ApiToken.objects.get(pk=token.pk).last_used_at is None
    assert tokens.copy_last_used() == 1
    used = ApiToken.objects.get(pk=token.pk).last_used_at
    assert used is not None and abs((timezone.now() - used).total_seconds()) < 60
    assert tokens.copy_last_used() == 0  # nothing new noted
    # Within the minute this process notes a token once; an older time never moves the date back.
    status(raw)
    assert not last_used.exists(tokens.LAST_USED_KEY)
    last_used.hset(tokens.LAST_USED_KEY, str(token.pk), (used - timedelta(days=1)).isoformat())
    assert tokens.copy_last_used() == 0
    assert ApiToken.objects.get(pk=token.pk).last_used_at == used


def test_a_redis_outage_loses_a_last_used_note_never_the_request(cat, last_used, settings):
    client = ServiceClientFactory(tenants=[cat.tenant])
    raw = issue_token(client, "tb_redis_down_token_aaaaaaaaaaaaa")
    tokens._redis.cache_clear()
    settings.REDIS_URL = "redis://127.0.0.1:1/0"
    try:
        assert status(raw) == 404
    finally:
        tokens._redis.cache_clear()


def test_rotation_can_retire_the_current_tokens_at_a_chosen_time(users, cat):
    client = ServiceClientFactory(tenants=[cat.tenant])
    old = issue_token(client, "tb_old_rotating_token_aaaaaaaaaaa")
    retire_at = (timezone.now() + timedelta(days=2)).replace(second=0, microsecond=0)
    expires = retire_at + timedelta(days=90)
    html = (
        login("platform")
        .post(
            reverse("admin:budgeting_serviceclient_rotate", args=[client.pk]),
            {
                "reason": "yearly rotation",
                "name": "gateway eu-1",
                "expires_at": expires.strftime("%Y-%m-%dT%H:%M"),
                "retire_at": retire_at.strftime("%Y-%m-%dT%H:%M"),
                "once": "yearly",
            },
        )
        .content.decode()
    )
    new = html.split('class="tb-token tb-mono">')[1].split("<")[0]
    assert "1 previous token stops working at" in html
    assert status(old) == 404 and status(new) == 404  # both work during the switch-over
    old_row = ApiToken.objects.get(token_hash=hash_token(old))
    new_row = ApiToken.objects.get(token_hash=hash_token(new))
    assert (old_row.expires_at, old_row.revoked_at) == (retire_at, None)
    assert (new_row.name, new_row.expires_at) == ("gateway eu-1", expires)
    record = ChangeRecord.objects.get(action="client.token_rotate")
    assert record.after["retiringTokens"] == 1 and record.after["name"] == "gateway eu-1"
    page = login("platform").get(reverse("admin:budgeting_serviceclient_change", args=[client.pk]))
    assert "gateway eu-1" in page.content.decode() and "Last used" in page.content.decode()
    # Retiring never extends a token: an earlier expiry stays.
    tokens.issue_token(
        client_id=client.pk,
        retire_current_at=retire_at + timedelta(days=9),
        reason="x",
        actor=BOB,
        now=timezone.now(),
    )
    assert ApiToken.objects.get(pk=old_row.pk).expires_at == retire_at


def test_the_rotation_form_refuses_times_in_the_past_and_both_choices(users, cat):
    client = ServiceClientFactory(tenants=[cat.tenant])
    past = (timezone.now() - timedelta(days=1)).strftime("%Y-%m-%dT%H:%M")
    future = (timezone.now() + timedelta(days=1)).strftime("%Y-%m-%dT%H:%M")
    url = reverse("admin:budgeting_serviceclient_rotate", args=[client.pk])
    html = login("platform").post(url, {"reason": "r", "expires_at": past}).content.decode()
    assert "Choose a time in the future." in html
    html = (
        login("platform")
        .post(url, {"reason": "r", "revoke_current": "on", "retire_at": future})
        .content.decode()
    )
    assert "not both" in html
    assert not ApiToken.objects.filter(client=client).exists()


def test_the_issue_token_command_names_expires_and_retires(cat):
    client = ServiceClientFactory(tenants=[cat.tenant], name="gw")
    old = issue_token(client, "tb_cli_old_token_aaaaaaaaaaaaaaaaa")
    out = StringIO()
    call_command(
        "issue_token",
        "gw",
        "--name",
        "eu-1",
        "--expires",
        "2099-01-01T00:00",
        "--retire-current",
        "2098-06-01T12:00",
        stdout=out,
    )
    text = out.getvalue()
    assert "1 current token(s) stop working at 2098-06-01 12:00 UTC" in text
    raw = text.rsplit(" ", 1)[-1].strip()
    new_row = ApiToken.objects.get(token_hash=hash_token(raw))
    assert new_row.name == "eu-1" and new_row.expires_at.year == 2099
    assert ApiToken.objects.get(token_hash=hash_token(old)).expires_at.year == 2098
    call_command("issue_token", "gw", "--retire-current", "now", stdout=StringIO())
    assert ApiToken.objects.filter(client=client, revoked_at__isnull=True).count() == 1
    assert ChangeRecord.objects.filter(action="client.token_rotate", actor_username="cli").count() == 2
