"""The pages people read (issue 19 §4), each a check in a real browser at 1440 and 375 px, with a screenshot
of each page in ``artifacts/screenshots/`` (named ``<width>-p<nn>-<page>``): the home page's "Daily work"
reads as lines, lists keep what a person needs in view (the state of a reservation, the numbers of an account,
a token's Revoke button on a phone; no table wider than its box on a desktop), refusals and missing objects
are the product's pages, the analyst's pages link to nothing it may not open, the policy editor keeps its
width, a new draft is a document, numbers and dates read as people
write them, the timeline is in time order, refreshing the token page issues nothing, and the limits preview
never shows NaN.

One browser per width; the three roles sign in once each."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.utils import timezone

from budgeting.catalog.changes import Actor
from budgeting.catalog.models import ApiToken, ServiceClient
from ledger.services import limits
from tests.e2e import test_browser
from tests.e2e.test_browser import DESKTOP, PHONE, Screen
from tests.factories import ServiceClientFactory, issue_token

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]
# The browser and the world of the roles' test, shared (pytest finds fixtures by their module name).
browser = test_browser.browser
world = test_browser.world

# Text that is a date, a time or an id: it must sit on one line.
# A date, an id, a model revision (``model@date``) or its model part: none of them broken over lines.
ONE_WORD = re.compile(
    r"^(\d{4}-\d{2}-\d{2}( \d{2}:\d{2}(:\d{2})?)?( UTC)?|req-[a-z0-9-]+|prov-[a-z0-9-]+"
    r"|[a-z0-9.-]+@(\d{4}-\d{2}-\d{2})?)$"
)


def in_view(screen: Screen, selector: str) -> None:
    """Every element matching ``selector`` is shown and lies within the page's width (nothing to scroll)."""
    boxes = screen.page.evaluate(
        """sel => [...document.querySelectorAll(sel)].map(e => { const r = e.getBoundingClientRect();
             return [r.width, r.right, getComputedStyle(e).display]; })""",
        selector,
    )
    assert boxes, f"{screen.page.url}: nothing matches {selector}"
    for width, right, display in boxes:
        assert display != "none" and width > 0, f"{selector} is hidden at {screen.width} px"
        assert right <= screen.width + 1, f"{selector} ends at {right} px, beyond {screen.width} px"


def dates_on_one_line(screen: Screen) -> None:
    broken = screen.page.evaluate(
        """re => [...document.querySelectorAll('td, th, time, .tb-sub')]
             .filter(e => e.children.length === 0 && new RegExp(re).test(e.textContent.trim()))
             .filter(e => { const r = document.createRange(); r.selectNodeContents(e);
                            const lines = new Set([...r.getClientRects()].map(x => Math.round(x.top)));
                            return lines.size > 1; })
             .map(e => e.textContent.trim())""",
        ONE_WORD.pattern,
    )
    assert broken == [], f"{screen.page.url}: broken over lines: {broken}"


def finance_reads(screen: Screen, world) -> None:
    page, account = screen.page, world["account"]
    screen.go("/admin/")
    screen.shot("p01-home")
    cells = page.evaluate(
        "[...document.querySelectorAll('#tb-operations td')].map(td => td.getBoundingClientRect().width)"
    )
    assert cells and min(cells) > (300 if screen.width == DESKTOP else 200), cells  # was one letter wide
    if screen.width == DESKTOP:
        assert page.evaluate("document.documentElement.scrollHeight") < 1600
    assert page.locator("text=View site").count() == 0

    screen.go("/admin/ledger/capacityaccount/")
    screen.shot("p02-accounts")
    in_view(screen, "#result_list td.field-input_available")
    in_view(screen, "#result_list td.field-output_available")
    assert not re.search(r"\d M\b", page.inner_text("#result_list"))  # one scale per row: exact counts

    screen.go("/admin/ledger/reservation/")
    screen.shot("p03-reservations")
    in_view(screen, "#result_list td.field-state_badge")
    in_view(screen, "#result_list td.field-input_col")
    dates_on_one_line(screen)

    screen.go(f"/admin/ledger/reservation/{world['scenario'].reservations['overrun'].pk}/change/")
    screen.shot("p04-reservation")
    times = page.eval_on_selector_all(".tb-timeline time", "ts => ts.map(t => t.textContent.trim())")
    assert len(times) > 3 and times == sorted(times)
    dates_on_one_line(screen)

    for path, name in (
        ("/admin/ledger/ledgerentry/", "p05-ledger-entries"),
        ("/admin/budgeting/temporaryincrease/", "p06-temporary-increases"),
        ("/admin/reconciliation/billingimport/", "p07-billing-imports"),
        (f"/admin/budgeting/manifest/{world['scenario'].manifests['full'].pk}/change/", "p08-manifest"),
    ):
        screen.go(path)
        screen.shot(name)
        dates_on_one_line(screen)
    assert "{'" not in page.inner_text("#content") and "60,000" in page.inner_text(".tb-record")

    # The limits preview with what a person may type: never NaN.
    screen.go(f"/admin/ledger/capacityaccount/{account.pk}/limits/")
    page.fill("#id_input_limit", "12.5M")
    assert "NaN" not in page.inner_text("#tb-preview")
    assert page.is_visible("#tb-preview-invalid")
    page.fill("#id_input_limit", "2,500,000")
    assert page.inner_text("#tb-preview tbody tr:first-child .tb-new") == "2,700,000"  # + the increase
    assert not page.is_visible("#tb-preview-invalid")
    # Spend is previewed as money, read from the digits typed (not a float's).
    spend = "#tb-preview tbody tr[data-field=id_spend_limit]"
    page.fill("#id_spend_limit", "5,000.1")
    assert page.inner_text(f"{spend} .tb-new") == "$5,000.10"
    page.fill("#id_spend_limit", "0.0000001")
    assert page.inner_text(f"{spend} .tb-new") == "?" and page.is_visible("#tb-preview-invalid")
    page.fill("#id_spend_limit", "")
    assert page.inner_text(f"{spend} .tb-new") == "∞" and not page.is_visible("#tb-preview-invalid")
    screen.shot("p09-limits-preview")

    # What does not exist is a 404 in the product's look, not a 403.
    missing = page.goto(f"{screen.base}/admin/ledger/capacityaccount/987654/limits/")
    assert missing is not None and missing.status == 404
    assert "Nothing here" in page.inner_text("#content") and page.is_visible("#site-name")
    screen.shot("p10-not-found")


def platform_reads(screen: Screen, world) -> None:
    page = screen.page
    screen.go("/admin/budgeting/changerecord/")
    screen.shot("p11-change-log")
    dates_on_one_line(screen)
    screen.go("/admin/budgeting/policyalias/")
    screen.shot("p12-aliases")

    # The policy editor: a new draft is a document, and the editor keeps its width.
    screen.go("/admin/budgeting/policyversion/add/")
    page.wait_for_selector(".cm-editor .cm-content")
    text = page.inner_text(".cm-editor .cm-content").strip()
    assert text.startswith("{") and "null" not in text.split("\n")[0]
    before = page.evaluate("document.querySelector('.cm-editor').getBoundingClientRect().width")
    page.click(".cm-editor .cm-content")
    page.keyboard.press("End")
    page.wait_for_timeout(200)
    after = page.evaluate("document.querySelector('.cm-editor').getBoundingClientRect().width")
    assert abs(after - before) <= 2 and after > screen.width * 0.5, (before, after)
    screen.shot("p13-policy-editor")

    # A token is issued once: refreshing the page that shows it issues no other.
    client: ServiceClient = ServiceClientFactory(tenants=[world["scenario"].tenant])  # type: ignore[assignment]
    issue_token(client, "tb_e2e_token_aaaaaaaaaaaaaaaaaaaa")
    screen.go(f"/admin/budgeting/serviceclient/{client.pk}/change/")
    in_view(screen, ".inline-group td.field-revoke a.button")
    screen.shot("p14-service-client")
    screen.go(f"/admin/budgeting/serviceclient/{client.pk}/rotate/")
    page.fill("#id_reason", "yearly rotation")
    page.click("input[type=submit]")
    page.wait_for_selector(".tb-token")
    assert ApiToken.objects.filter(client=client).count() == 2
    page.reload()
    page.wait_for_load_state()
    assert ApiToken.objects.filter(client=client).count() == 2
    assert "issued already" in page.inner_text("body")
    screen.shot("p15-token-refreshed")


def analyst_reads(screen: Screen, world) -> None:
    page = screen.page
    refused = page.goto(f"{screen.base}/admin/ledger/capacityaccount/{world['account'].pk}/limits/")
    assert refused is not None and refused.status == 403
    assert "You may not open this page" in page.inner_text("#content") and page.is_visible("#site-name")
    screen.shot("p16-refused")
    links: set[str] = set()
    for path in (
        "/admin/",
        "/admin/budgeting/usagereport/",
        "/admin/ledger/capacityaccount/",
        f"/admin/ledger/capacityaccount/{world['account'].pk}/change/",
        "/admin/ledger/reservation/reconciling/",
        f"/admin/ledger/reservation/{world['scenario'].reservations['unknown'].pk}/change/",
        f"/admin/budgeting/manifest/{world['scenario'].manifests['full'].pk}/change/",
    ):
        screen.go(path)
        links |= set(
            page.eval_on_selector_all(
                "a[href^='/admin/']", "as => as.map(a => a.getAttribute('href').split('#')[0])"
            )
        )
    links = {link for link in links if "logout" not in link and "/delete/" not in link}
    into_403 = sorted(link for link in links if page.request.get(screen.base + link).status == 403)
    assert len(links) > 14 and into_403 == []
    screen.go(f"/admin/ledger/capacityaccount/{world['account'].pk}/change/")
    screen.shot("p17-analyst-account")


@pytest.mark.parametrize("width", [DESKTOP, PHONE])
def test_the_pages_people_read(browser, live_server, world, width):
    now = timezone.now()
    limits.grant_temporary_increase(
        account_id=world["account"].pk,
        input_tokens=200_000,
        output_tokens=0,
        concurrency=0,
        expires_at=now + timedelta(days=3),
        reason="quarter-end push",
        actor=Actor(user_id=None, username="finance"),
        now=now,
    )
    finance_reads(Screen(browser, live_server.url, "finance", width), world)
    platform_reads(Screen(browser, live_server.url, "platform", width), world)
    analyst_reads(Screen(browser, live_server.url, "analyst", width), world)
