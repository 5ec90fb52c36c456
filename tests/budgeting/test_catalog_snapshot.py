"""The in-process catalog snapshot: one statement while nothing changed, reloaded the moment anything does
(database triggers bump the version in the changing transaction), in every process."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from django.db import connection
from django.utils import timezone

from budgeting.catalog import snapshot
from budgeting.catalog.models import ApiToken, PolicyAlias, Tenant
from ledger.models import CapacityAccount
from tests import live
from tests.api.test_admissions import request_body
from tests.dbwork import count_db_work
from tests.demo import DEMO_TOKEN

pytestmark = pytest.mark.django_db(transaction=True)


def version() -> int | None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT version FROM budgeting_catalogversion WHERE id = 1")
        row = cursor.fetchone()
    return None if row is None else row[0]


def test_an_unchanged_catalog_costs_one_statement_and_keeps_its_snapshot(demo_api):
    first, _ = snapshot.current()
    with count_db_work() as work:
        second, db_now = snapshot.current()
    assert second is first
    assert len(work.statements) == 1, work.summary()
    assert db_now.tzinfo is not None


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda: Tenant.objects.filter(slug="t-19").update(name="Acme"), id="tenant edit"),
        pytest.param(lambda: ApiToken.objects.update(revoked_at=timezone.now()), id="token revoked"),
        pytest.param(lambda: PolicyAlias.objects.update(global_cap_floor=1000), id="policy alias"),
        pytest.param(lambda: CapacityAccount.objects.filter(scope="POOL").delete(), id="account removed"),
    ],
)
def test_every_kind_of_change_bumps_the_version_and_reloads_the_snapshot(demo_api, change):
    before, _ = snapshot.current()
    change()
    after, _ = snapshot.current()
    assert after.version != before.version
    assert after is not before


def test_balance_updates_do_not_bump_the_version(demo_api):
    """Negative control: the hot path's balance updates must not invalidate every process's snapshot."""
    start = version()
    CapacityAccount.objects.update(input_reserved=5)
    assert version() == start


def test_a_change_in_one_process_is_in_force_for_the_next_request_of_another(demo_api):
    """The test process edits the catalog; a gunicorn worker (another process, its snapshot warm) answers
    the very next request under the new catalog: a revoked token is refused, a new policy cap is applied."""

    def post(base: str) -> tuple[int, dict]:
        req = urllib.request.Request(
            f"{base}/api/v1/admissions:count",
            data=json.dumps(request_body()).encode(),
            method="POST",
            headers={"Authorization": f"Bearer {DEMO_TOKEN}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=300) as res:
                return res.status, json.loads(res.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    with live.gunicorn() as base:
        status, body = post(base)
        assert status == 200
        assert post(base)[1]["budget"] == body["budget"]  # warm: the worker's snapshot is in use
        PolicyAlias.objects.update(global_cap_floor=500)
        status, capped = post(base)
        assert status == 200
        assert capped["budget"]["input"] <= 500 < body["budget"]["input"]
        ApiToken.objects.update(revoked_at=timezone.now())
        status, refused = post(base)
        assert (status, refused["code"]) == (401, "UNAUTHENTICATED")
