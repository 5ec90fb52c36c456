"""The three roles doing their jobs in a real browser (headless Chromium driven by Playwright), on a desktop
(1440 px) and on a phone (375 px):

finance raises a limit typed with separators (form, live preview, confirmation), reads the account's cost,
imports the sample billing export and resolves a reservation that needs a person; platform activates a policy
version and rolls it back; the analyst opens the report (charts drawn by the vendored Chart.js) and downloads
the CSV. Every page is checked for sideways overflow, and screenshots go to ``artifacts/screenshots/`` for a
person to look at.

Needs Chromium: skipped only when the Debian ``chromium`` package is absent (``.ci/run`` installs it);
Playwright's own browser download is not used (it cannot reach the network on these machines).
"""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.conf import settings
from django.db import connections
from django.db.models import F, Sum
from django.utils import timezone

from budgeting.backoffice.roles import sync_roles
from budgeting.catalog.models import PolicyAlias, PolicyState, PolicyVersion
from ledger.models import CapacityAccount, Reservation, State
from ledger.services import settlement
from reconciliation.models import BillingImport
from tests.admin.conftest import PASSWORD, ROLES, make_user, policy_document
from tests.admin.scenario import populate
from tests.ledger.helpers import catalog, pool_account, tenant_account

CHROMIUM = Path("/usr/bin/chromium")
SCREENSHOTS = Path(__file__).resolve().parents[2] / "artifacts" / "screenshots"
SAMPLE_EXPORT = Path(settings.BASE_DIR) / "budgeting" / "demo" / "billing-sample.csv"
LAUNCH_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
DESKTOP, PHONE = 1440, 375

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
            # The ORM calls made while Playwright runs (the test's, and those of its fixtures set up after
            # this one) used a connection of their own: Playwright's greenlets carry their own context.
            # Close it, or it is still open when the test database is dropped.
            connections.close_all()
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


class Screen:
    """One signed-in person's browser at one width: screenshots named by width and step, and the layout
    checks every page must pass."""

    def __init__(self, browser, base: str, username: str, width: int) -> None:
        self.base, self.width = base, width
        context = browser.new_context(
            viewport={"width": width, "height": 900 if width == DESKTOP else 812},
            accept_downloads=True,
        )
        self.page = context.new_page()
        self.page.goto(f"{base}/admin/login/")
        self.page.fill("#id_username", username)
        self.page.fill("#id_password", PASSWORD)
        self.page.click("input[type=submit]")
        self.page.wait_for_selector("#site-name")

    def go(self, path: str) -> None:
        response = self.page.goto(self.base + path)
        assert response is not None and response.status == 200, path

    def shot(self, name: str) -> None:
        """Take a full-page screenshot, then check the layout."""
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(SCREENSHOTS / f"{self.width}-{name}.png"), full_page=True)
        self.fits()

    def fits(self) -> None:
        """The page never scrolls sideways; on a desktop, no table scrolls inside its box either (every
        column of the reconciling backlog, the reservations list and the ledger tables is in view)."""
        overflow = self.page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 1, f"{self.page.url} is {overflow} px wider than {self.width} px"
        if self.width == DESKTOP:
            clipped = self.page.evaluate(
                """[...document.querySelectorAll('.results, .tb-scroll')]
                     .filter(box => box.scrollWidth > box.clientWidth + 1)
                     .map(box => (box.querySelector('table') || box).id || box.className)"""
            )
            assert clipped == [], f"{self.page.url}: tables wider than their box: {clipped}"

    def charts_drawn(self) -> int:
        """Wait until every chart canvas has its Chart.js chart, with a size; returns how many."""
        self.page.wait_for_function(
            """() => window.Chart && [...document.querySelectorAll('canvas[data-tb-chart]')]
                 .every(c => Chart.getChart(c) && c.clientWidth > 100 && c.clientHeight > 100)"""
        )
        return int(self.page.evaluate("document.querySelectorAll('canvas[data-tb-chart]').length"))


def finance_job(screen: Screen, world) -> None:
    account = world["account"]
    page = screen.page
    screen.go("/admin/")
    screen.shot("01-home-finance")
    screen.go("/admin/ledger/capacityaccount/")
    screen.shot("02-accounts")
    page.click("#result_list a:has-text('tenant t-19')")
    page.wait_for_selector("#tb-cost-to-date")
    assert "$0.02" in page.inner_text("#tb-cost-to-date")
    screen.shot("03-account")
    page.click("text=Edit limits…")
    assert page.input_value("#id_input_limit") == "1,000,000"
    page.fill("#id_input_limit", "2,500,000")
    page.fill("#id_reason", "Q4 budget approved")
    assert page.inner_text("#tb-preview tbody tr:first-child .tb-new") == "2,500,000"
    screen.shot("04-limit-form")
    page.click("input[value='Preview the change']")
    page.wait_for_selector("text=What changes")
    screen.shot("05-limit-confirm")
    page.click("input[value='Save limits']")
    page.wait_for_selector(".messagelist .success")
    assert "saved" in page.inner_text(".messagelist")
    screen.shot("06-account-after")
    assert CapacityAccount.objects.get(pk=account.pk).input_limit == 2_500_000
    screen.go(f"/admin/ledger/reservation/{world['scenario'].reservations['dedup'].pk}/change/")
    screen.shot("07-reservation")
    screen.go("/admin/ledger/reservation/")
    screen.shot("08-reservations")
    screen.go("/admin/ledger/ledgerentry/")
    screen.shot("09-ledger-entries")

    # The sample billing export in the repository is accepted; the result is a sentence and a table.
    screen.go("/admin/reconciliation/billingimport/upload/")
    page.set_input_files("#id_export", str(SAMPLE_EXPORT))
    page.fill("#id_reason", "the sample export")
    page.click("input[value='Import']")
    page.wait_for_selector("#tb-import-result")
    assert page.inner_text(".messagelist").startswith("Imported billing-sample.csv: 3 records")
    screen.shot("10-billing-import")
    assert BillingImport.objects.count() == 1

    # The reconciler finds contradicting evidence: the call now waits for a person, who resolves it.
    unknown = world["scenario"].reservations["unknown"]
    screen.go("/admin/ledger/reservation/reconciling/")
    assert screen.charts_drawn() == 1
    screen.shot("11-backlog")
    assert settlement.flag_for_person(
        reservation_id=unknown.pk,
        fence=Reservation.objects.get(pk=unknown.pk).fence,
        reason="provider said not processed, but usage was captured",
        now=timezone.now(),
    )
    screen.go("/admin/ledger/reservation/reconciling/")
    assert "usage was captured" in page.inner_text("#tb-needs-person")
    screen.shot("12-backlog-needs-a-person")
    page.click("#tb-needs-person a:has-text('Resolve…')")
    page.check("input[value='AS_RECORDED']")
    page.fill("#id_reason", "provider support confirmed the call ran")
    screen.shot("13-resolve-form")
    page.click("input[value='Preview the change']")
    page.wait_for_selector("text=What changes")
    screen.shot("14-resolve-confirm")
    page.click("input[value='Resolve']")
    page.wait_for_selector(".messagelist .success")
    assert Reservation.objects.get(pk=unknown.pk).state == State.SETTLED
    screen.shot("15-resolved-reservation")
    screen.go(f"/admin/budgeting/usagereport/tenant/{world['scenario'].tenant.slug}/")
    assert "$0.02" in page.inner_text("#tb-spend-to-date")
    screen.shot("16-tenant-spend")


def platform_job(screen: Screen, world) -> None:
    page = screen.page
    screen.go(f"/admin/budgeting/policyversion/{world['r19'].pk}/change/")
    page.click("text=Activate as production…")
    page.wait_for_selector("text=Policy document changes")
    page.fill("#id_reason", "roll out r19")
    screen.shot("17-activate-confirm")
    page.click("input[value='Activate r19']")
    page.wait_for_selector(".messagelist .success")
    assert PolicyAlias.objects.get(name="production").version_id == world["r19"].pk
    page.click("#result_list a:text-is('production')")
    page.click("text=Roll back to r18…")
    page.fill("#id_reason", "r19 rejects too much")
    screen.shot("18-rollback-confirm")
    page.click("input[value='Roll back to r18']")
    page.wait_for_selector(".messagelist .success")
    assert "rolled back to r18" in page.inner_text(".messagelist")
    screen.shot("19-alias-after-rollback")
    alias = PolicyAlias.objects.get(name="production")
    assert (alias.version_id, alias.global_cap_floor) == (world["r18"].pk, 50000)
    screen.go("/admin/budgeting/changerecord/")
    screen.shot("20-change-log")


def analyst_job(screen: Screen, world) -> None:
    page = screen.page
    screen.go("/admin/")
    page.click("text=Usage report")
    # The backlog chart is empty: finance resolved the one reconciling call.
    assert screen.charts_drawn() == 2
    assert "Nothing is reconciling." in page.inner_text("#tb-chart-backlog-figure")
    assert "bytes / 4" in page.inner_text("#tb-chart-deviation-figure")
    screen.shot("21-report")
    with page.expect_download() as download:
        page.click("#tb-export-csv")
    text = Path(download.value.path()).read_text()
    rows = list(csv.DictReader(io.StringIO(text)))
    admitted = Reservation.objects.exclude(state__in=[State.PROPOSED, State.REJECTED])
    sums = admitted.aggregate(i=Sum("input_consumed"), o=Sum(F("captured") + F("overrun")))
    assert sum(int(r["requests"]) for r in rows) == admitted.count()
    assert sum(int(r["inputTokens"]) for r in rows) == sums["i"]
    assert sum(int(r["outputTokens"]) for r in rows) == sums["o"]
    limits_page = page.goto(f"{screen.base}/admin/ledger/capacityaccount/{world['account'].pk}/limits/")
    assert limits_page is not None and limits_page.status == 403


@pytest.mark.parametrize("width", [DESKTOP, PHONE])
def test_finance_platform_and_analyst_do_their_jobs_in_the_browser(browser, live_server, world, width):
    finance_job(Screen(browser, live_server.url, "finance", width), world)
    platform_job(Screen(browser, live_server.url, "platform", width), world)
    analyst_job(Screen(browser, live_server.url, "analyst", width), world)
