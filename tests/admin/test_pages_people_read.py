"""The pages people read (issue 19 §4), what a test client can see of them: refusals and missing objects
answer with the product's pages (403 and 404, never 403 for what does not exist), no page links into a 403,
no "View site" into a 404, numbers written for people (no bare "27061", no Python dict), a new policy draft
that does not start as ``null``, a lifecycle timeline in time order, and "updated at" that moves. What needs
a browser (widths, the editor, the live preview) is in tests/e2e."""

from __future__ import annotations

import re
from html.parser import HTMLParser

import pytest
from django.urls import reverse

from budgeting.backoffice.reservation_admin import timeline
from budgeting.catalog import policies as policy_services
from budgeting.catalog.changes import Actor
from budgeting.catalog.models import PolicyAlias
from ledger.models import Reservation
from tests.admin.conftest import login

pytestmark = pytest.mark.django_db
MISSING = 987654


class Links(HTMLParser):
    """The admin links of a page (the log-out link and deletions left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        href = dict(attrs).get("href") or ""
        if tag == "a" and href.startswith("/admin/") and "logout" not in href and "/delete/" not in href:
            self.links.append(href.split("#")[0])


def crawl(role: str, limit: int = 400) -> dict[str, tuple[int, str]]:
    """Every admin page reachable by links from the home page (query strings aside), as status and HTML."""
    client = login(role)
    seen: dict[str, tuple[int, str]] = {}
    queue = ["/admin/"]
    while queue and len(seen) < limit:
        url = queue.pop(0)
        if url in seen:
            continue
        response = client.get(url)
        html = response.content.decode() if "text/html" in response.get("Content-Type", "") else ""
        seen[url] = (response.status_code, html)
        if response.status_code == 200 and html:
            parser = Links()
            parser.feed(html)
            queue += [link for link in parser.links if "?" not in link and link not in seen]
    return seen


def visible_text(html: str) -> str:
    return re.sub(
        r"<script.*?</script>|<style.*?</style>|<textarea.*?</textarea>|<pre.*?</pre>", "", html, flags=re.S
    )


@pytest.mark.parametrize("role", ["analyst", "finance", "platform"])
def test_no_page_links_into_a_refusal_and_numbers_are_written_for_people(role, users, scenario, policies):
    pages = crawl(role)
    assert len(pages) > 40
    refused = sorted(url for url, (status, _) in pages.items() if status == 403)
    assert refused == [], f"{role} is shown links into 403: {refused}"
    for url, (_status, html) in pages.items():
        text = visible_text(html)
        # Ids are links ("#36610530" opens the entry): only the other figures need separators.
        bare = re.findall(r"(?<!</a)>\s*([0-9]{5,})\s*<(?!/a>)", text)
        assert not bare, f"{url} shows counts without separators: {bare}"
        assert "{&#x27;" not in text and "{'" not in text, f"{url} shows a Python dict"
        assert "View site" not in html and "Django administration" not in html, url


def test_a_refusal_is_a_page_of_the_product(users, scenario):
    account = scenario.tenant.accounts.get()
    response = login("analyst").get(reverse("admin:ledger_capacityaccount_limits", args=[account.pk]))
    html = response.content.decode()
    assert response.status_code == 403
    assert "You may not open this page" in html and "Token budget" in html and "analyst" in html
    assert 'href="/admin/"' in html and "admin.css" in html


@pytest.mark.parametrize(
    "name",
    [
        "admin:ledger_capacityaccount_limits",
        "admin:ledger_capacityaccount_increase",
        "admin:ledger_capacityaccount_correction",
        "admin:budgeting_manifest_replay",
        "admin:budgeting_serviceclient_rotate",
        "admin:budgeting_policyversion_validate",
        "admin:budgeting_policyversion_activate",
        "admin:budgeting_policyalias_rollback",
        "admin:reconciliation_billingimport_remove",
    ],
)
def test_what_does_not_exist_is_not_found_even_for_a_superuser(name, users):
    response = login("root").get(reverse(name, args=[MISSING]))
    assert response.status_code == 404
    assert "Nothing here" in response.content.decode()


def test_a_missing_reservation_or_token_is_not_found(users, cat):
    root = login("root")
    missing = "00000000-0000-0000-0000-000000000000"
    assert root.get(reverse("admin:ledger_reservation_resolve", args=[missing])).status_code == 404
    assert (
        root.get(reverse("admin:budgeting_serviceclient_revoke_token", args=[MISSING, 1])).status_code == 404
    )


def test_there_is_no_view_site_link_into_a_bare_404(users):
    html = login("finance").get(reverse("admin:index")).content.decode()
    assert "View site" not in html
    assert login("finance").get("/").status_code == 404


def test_a_blank_policy_draft_starts_from_a_document_not_null(users, policies):
    html = login("platform").get(reverse("admin:budgeting_policyversion_add")).content.decode()
    area = re.search(r"<textarea[^>]*data-policy-editor[^>]*>(.*?)</textarea>", html, flags=re.S)
    assert area is not None
    text = area.group(1).strip()
    assert text != "null" and text.startswith("{") and "&quot;revision&quot;: 21" in text
    PolicyAlias.objects.all().delete()
    html = login("platform").get(reverse("admin:budgeting_policyversion_add")).content.decode()
    area = re.search(r"<textarea[^>]*data-policy-editor[^>]*>(.*?)</textarea>", html, flags=re.S)
    assert area is not None and area.group(1).strip().startswith("{")


def test_the_lifecycle_timeline_reads_in_time_order(scenario):
    for reservation in Reservation.objects.all():
        times = [item.at for item in timeline(reservation)]
        assert times == sorted(times), reservation.request_id


def test_the_manifest_record_shows_nested_values_readably(users, scenario):
    manifest = scenario.manifests["full"]
    html = (
        login("analyst").get(reverse("admin:budgeting_manifest_change", args=[manifest.pk])).content.decode()
    )
    record = html[html.index("tb-record") : html.index("Ladder steps")]
    assert "60,000" in record, record
    assert "contextWindow 32,768" in record and "maxOutput 4,096" in record
    assert "{&#x27;" not in record


def test_updated_at_moves_when_the_alias_moves(users, policies):
    alias = PolicyAlias.objects.get(name="production")
    before = alias.updated_at
    platform = Actor(user_id=None, username="platform")
    policy_services.activate(
        alias_name="production",
        version_id=policies["r19"].pk,
        expected_version_id=alias.version_id,
        reason="roll out r19",
        actor=platform,
    )
    moved = PolicyAlias.objects.get(pk=alias.pk).updated_at
    assert moved > before
    policy_services.rollback(
        alias_name="production", expected_version_id=policies["r19"].pk, reason="back", actor=platform
    )
    assert PolicyAlias.objects.get(pk=alias.pk).updated_at > moved


def test_an_account_page_says_when_its_balances_last_moved(users, scenario):
    account = scenario.tenant.accounts.get()
    html = (
        login("finance")
        .get(reverse("admin:ledger_capacityaccount_change", args=[account.pk]))
        .content.decode()
    )
    assert "Last balance movement" in html and "entry #" in html
    assert "Updated at" not in html
