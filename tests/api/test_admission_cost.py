"""The admission path's database cost, counted (deterministic proxies of its latency): one transaction and one
commit per admission, at most 6 statements for a warm admission."""

from __future__ import annotations

import pytest

from ledger.models import LedgerEntry, Reservation, State
from tests.api.test_admissions import request_body
from tests.dbwork import DbWork, count_db_work

pytestmark = pytest.mark.django_db(transaction=True)

MAX_ADMISSION_STATEMENTS = 6


def admit(demo_api, n: int) -> tuple[dict, DbWork]:
    body = request_body(requestId=f"cost-{n}")
    with count_db_work() as work:
        res = demo_api.post("/api/v1/admissions", body, format="json", HTTP_IDEMPOTENCY_KEY=f"cost-{n}")
    assert res.status_code == 201, res.content[:300]
    return res.json(), work


def test_a_warm_admission_is_one_transaction_one_commit_and_few_statements(demo_api):
    admit(demo_api, 0)  # warms the process: catalog snapshot, accounts, count cache
    body, work = admit(demo_api, 1)
    assert len(work.statements) <= MAX_ADMISSION_STATEMENTS, work.summary()
    assert work.commits == 1, work.summary()
    assert work.transactions <= 2, work.summary()
    reservation = Reservation.objects.get(pk=body["reservationId"])
    assert reservation.state == State.RESERVED
    assert reservation.manifest_id == body["manifestId"]
