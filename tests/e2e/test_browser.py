"""The three roles doing their jobs in a real browser (headless Chromium driven by Playwright):

finance raises a limit (form, live preview, confirmation); platform activates a policy version and rolls it
back; the analyst opens the report and downloads the CSV. Screenshots of the main pages go to
``artifacts/screenshots/`` for a person to look at.

Skipped only when the Debian ``chromium`` package is absent (``.ci/run`` installs it); Playwright's own
browser download is not used (it cannot reach the network on these machines).
"""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.db import connections
from django.db.models import F, Sum

from budgeting.backoffice.roles import sync_roles
from budgeting.catalog.models import PolicyAlias, PolicyState, PolicyVersion
from ledger.models import CapacityAccount, Reservation, State
from tests.admin.conftest import PASSWORD, ROLES, make_user, policy_document
from tests.admin.scenario import populate
from tests.ledger.helpers import catalog, pool_account, tenant_account

CHROMIUM = Path("/usr/bin/chromium")
SCREENSHOTS = Path(__file__).resolve().parents[2] / "artifacts" / "screenshots"
LAUNCH_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} is absent: apt-get install chromium"),
    pytest.mark.django_db(transaction=True),
]


@pytest.fixture
def browser() -> Iterator[object]:
    from playwright.sync_api import sync_playwright

    # Playwright's sync API runs an event loop in this thread; Django then refuses ORM calls from it unless
    # told that this (test-only) thread is not serving async requests.
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    try:
        with sync_playwright() as playwright:
            chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=LAUNCH_ARGS)
            yield chromium
            chromium.close()
    finally:
        os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)


@pytest.fixture
def world(transactional_db):
    # An earlier transactional test's flush may have emptied the groups the data migration made.
    sync_roles()
    for role in ROLES:
        make_user(role, role=role)
    cat = catalog(tenant_slug="t-19", pool_slug="eu-large", task_slug="contract-review")
    account = tenant_account(cat, input_limit=1_000_000, output_limit=100_000, concurrency_limit=10)
    pool_account(cat, input_limit=5_000_000, output_limit=500_000, concurrency_limit=50)
    scenario = populate(tenant=cat.tenant, task_class=cat.task_class, pool=cat.pool, model=cat.model)
    r18 = PolicyVersion.objects.create(revision=18, state=PolicyState.VALIDATED, document=policy_document(18))
    r19 = PolicyVersion.objects.create(
        revision=19, state=PolicyState.VALIDATED, document=policy_document(19, cap=50000)
    )
    PolicyAlias.objects.create(name="production", version=r18)
    return {"account": account, "scenario": scenario, "r18": r18, "r19": r19}


def signed_in(browser, base: str, username: str):
    context = browser.new_context(viewport={"width": 1400, "height": 900}, accept_downloads=True)
    page = context.new_page()
    page.goto(f"{base}/admin/login/")
    page.fill("#id_username", username)
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    page.wait_for_selector("#site-name")
    return page


def shot(page, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)


def test_finance_platform_and_analyst_do_their_jobs_in_the_browser(browser, live_server, world):
    base = live_server.url
    account = world["account"]

    # Finance raises the input limit of tenant t-19: list, account page, form with live preview, confirm.
    finance = signed_in(browser, base, "finance")
    finance.goto(f"{base}/admin/")
    shot(finance, "01-home-finance")
    finance.click("text=Capacity accounts >> nth=0")
    finance.wait_for_selector("#result_list")
    shot(finance, "02-accounts")
    finance.click("#result_list a:has-text('tenant t-19')")
    finance.click("text=Edit limits…")
    finance.fill("#id_input_limit", "2500000")
    finance.fill("#id_reason", "Q4 budget approved")
    assert finance.inner_text("#tb-preview tbody tr:first-child .tb-new") == "2,500,000"
    shot(finance, "03-limit-form")
    finance.click("input[value='Preview the change']")
    finance.wait_for_selector("text=What changes")
    shot(finance, "04-limit-confirm")
    finance.click("input[value='Save limits']")
    finance.wait_for_selector(".messagelist .success")
    assert "saved" in finance.inner_text(".messagelist")
    shot(finance, "05-account-after")
    assert CapacityAccount.objects.get(pk=account.pk).input_limit == 2_500_000
    finance.goto(f"{base}/admin/ledger/reservation/reconciling/")
    shot(finance, "06-reconciling-backlog")
    finance.goto(f"{base}/admin/ledger/reservation/{world['scenario'].reservations['dedup'].pk}/change/")
    shot(finance, "07-reservation")

    # Platform activates r19 and rolls it back, each through its confirmation page.
    platform = signed_in(browser, base, "platform")
    platform.goto(f"{base}/admin/budgeting/policyversion/{world['r19'].pk}/change/")
    platform.click("text=Activate as production…")
    platform.wait_for_selector("text=Policy document changes")
    platform.fill("#id_reason", "roll out r19")
    shot(platform, "08-activate-confirm")
    platform.click("input[value='Activate r19']")
    platform.wait_for_selector(".messagelist .success")
    assert PolicyAlias.objects.get(name="production").version_id == world["r19"].pk
    platform.click("#result_list a:text-is('production')")
    platform.click("text=Roll back to r18…")
    platform.fill("#id_reason", "r19 rejects too much")
    shot(platform, "09-rollback-confirm")
    platform.click("input[value='Roll back to r18']")
    platform.wait_for_selector(".messagelist .success")
    assert "rolled back to r18" in platform.inner_text(".messagelist")
    shot(platform, "10-alias-after-rollback")
    alias = PolicyAlias.objects.get(name="production")
    assert (alias.version_id, alias.global_cap_floor) == (world["r18"].pk, 50000)
    platform.goto(f"{base}/admin/budgeting/changerecord/")
    shot(platform, "11-change-log")

    # The analyst opens the report and downloads the CSV; its totals are the database's.
    analyst = signed_in(browser, base, "analyst")
    analyst.goto(f"{base}/admin/")
    analyst.click("text=Usage report")
    analyst.wait_for_selector("svg.tb-chart")
    shot(analyst, "12-report")
    with analyst.expect_download() as download:
        analyst.click("#tb-export-csv")
    text = Path(download.value.path()).read_text()
    rows = list(csv.DictReader(io.StringIO(text)))
    admitted = Reservation.objects.exclude(state__in=[State.PROPOSED, State.REJECTED])
    sums = admitted.aggregate(i=Sum("input_consumed"), o=Sum(F("captured") + F("overrun")))
    assert sum(int(r["requests"]) for r in rows) == admitted.count()
    assert sum(int(r["inputTokens"]) for r in rows) == sums["i"]
    assert sum(int(r["outputTokens"]) for r in rows) == sums["o"]
    assert analyst.goto(f"{base}/admin/ledger/capacityaccount/").status == 403
    # Queries made here, between Playwright calls, ran on a connection of their own (Playwright's greenlets
    # carry their own context); close it, or it would still be open when the test database is dropped.
    connections.close_all()
