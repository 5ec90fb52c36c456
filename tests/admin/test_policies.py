"""Platform's policy work: drafts validated field by field, diffs, activation and rollback by compare-and-swap
(the rollback keeps the lower cap and clears the count cache), all through confirmation pages."""

from __future__ import annotations

import json
from io import StringIO
from pathlib import Path

import pytest
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from budgeting.admission.count_cache import RedisCountCache
from budgeting.catalog import policies as policy_services
from budgeting.catalog.changes import Actor
from budgeting.catalog.errors import Conflict
from budgeting.catalog.models import ChangeRecord, PolicyAlias, PolicyState, PolicyVersion
from budgeting.catalog.policies import AliasMoved, NothingToRollBack, NotValidated
from budgeting.catalog.policy_schema import schema
from tests.admin.conftest import login, policy_document
from tests.ledger.helpers import run_concurrently

pytestmark = pytest.mark.django_db
BOB = Actor(user_id=None, username="bob")


def alias() -> PolicyAlias:
    return PolicyAlias.objects.select_related("version", "previous").get(name="production")


def activate_r19(policies: dict[str, PolicyVersion]) -> None:
    """production moves from r18 to r19 (whose global cap is lower)."""
    policy_services.activate(
        alias_name="production",
        version_id=policies["r19"].pk,
        expected_version_id=policies["r18"].pk,
        reason="r19",
        actor=BOB,
    )


def add_draft(client, revision: int, document: object) -> str:
    """Post a new draft (a str document is sent as typed); returns the page when the form is refused."""
    text = document if isinstance(document, str) else json.dumps(document)
    response = client.post(
        reverse("admin:budgeting_policyversion_add"),
        {"revision": revision, "note": "", "document": text, "change_reason": "try"},
    )
    return response.content.decode() if response.status_code == 200 else ""


def test_a_draft_with_an_invalid_field_is_refused_naming_the_field(users, policies):
    platform = login("platform")
    bad = policy_document(21, ladder=["DEDUP_EVIDENCE", "QUEUE_OR_REJECT"])
    html = add_draft(platform, 21, bad)
    assert (
        "taskClasses.contract-review.ladder: a ladder starts with FULL and ends with QUEUE_OR_REJECT" in html
    )
    wrong_revision = add_draft(platform, 21, policy_document(22))
    assert "revision: must be 21" in wrong_revision
    assert (
        "Not valid JSON: Expecting property name enclosed in double quotes at line 1, column 2"
        in add_draft(platform, 21, "{")
    )
    assert "(document): expected an object" in add_draft(platform, 21, "42")
    assert not PolicyVersion.objects.filter(revision=21).exists()
    assert add_draft(platform, 21, policy_document(21)) == ""
    draft = PolicyVersion.objects.get(revision=21)
    assert draft.state == PolicyState.DRAFT
    assert ChangeRecord.objects.filter(action="policyversion.add", target_id=str(draft.pk)).exists()


def test_copy_as_new_draft_prefills_the_next_revision(users, policies):
    html = (
        login("platform")
        .get(reverse("admin:budgeting_policyversion_add") + f"?copy_of={policies['r18'].pk}")
        .content.decode()
    )
    assert 'value="21"' in html and "&quot;revision&quot;: 21" in html


def test_validated_versions_are_view_only_in_the_admin(users, policies):
    platform = login("platform")
    url = reverse("admin:budgeting_policyversion_change", args=[policies["r18"].pk])
    assert 'name="document"' not in platform.get(url).content.decode()
    draft_url = reverse("admin:budgeting_policyversion_change", args=[policies["r20"].pk])
    assert 'name="document"' in platform.get(draft_url).content.decode()


def test_validate_freezes_a_draft_once(policies):
    version = policy_services.validate_version(
        version_id=policies["r20"].pk, reason="ok", actor=BOB, now=timezone.now()
    )
    assert version.state == PolicyState.VALIDATED
    with pytest.raises(Conflict):
        policy_services.validate_version(
            version_id=policies["r20"].pk, reason="ok", actor=BOB, now=timezone.now()
        )


def test_diff_lists_changed_leaves_by_path():
    old = policy_document(18, cap=60000)
    new = policy_document(19, cap=50000, ladder=["FULL", "QUEUE_OR_REJECT"])
    new["taskClasses"]["contract-review"]["queue"] = {"allowed": False}
    lines = {line.path: line for line in policy_services.diff_documents(old, new)}
    assert lines["globalMaxInputTokens"].kind == "changed"
    assert (lines["globalMaxInputTokens"].old, lines["globalMaxInputTokens"].new) == ("60,000", "50,000")
    assert lines["taskClasses.contract-review.ladder"].kind == "changed"
    assert lines["taskClasses.contract-review.queue.allowed"].kind == "added"
    assert "taskClasses.contract-review.inputCap" not in lines
    assert policy_services.diff_documents(old, old) == []


def test_activation_is_a_compare_and_swap(policies):
    with pytest.raises(AliasMoved):
        policy_services.activate(
            alias_name="production",
            version_id=policies["r19"].pk,
            expected_version_id=policies["r19"].pk,
            reason="stale page",
            actor=BOB,
        )
    assert alias().version_id == policies["r18"].pk
    done = policy_services.activate(
        alias_name="production",
        version_id=policies["r19"].pk,
        expected_version_id=policies["r18"].pk,
        reason="roll out r19",
        actor=BOB,
    )
    assert (done.plan.from_revision, done.plan.to_revision) == (18, 19)
    moved = alias()
    assert (moved.version_id, moved.previous_id, moved.global_cap_floor) == (
        policies["r19"].pk,
        policies["r18"].pk,
        None,
    )
    with pytest.raises(NotValidated):
        policy_services.activate(
            alias_name="production",
            version_id=policies["r20"].pk,
            expected_version_id=policies["r19"].pk,
            reason="draft",
            actor=BOB,
        )


@pytest.mark.django_db(transaction=True)
def test_two_admins_activating_at_once_cannot_both_win():
    r18 = PolicyVersion.objects.create(revision=18, state=PolicyState.VALIDATED, document=policy_document(18))
    candidates = [
        PolicyVersion.objects.create(
            revision=30 + i, state=PolicyState.VALIDATED, document=policy_document(30 + i)
        )
        for i in range(4)
    ]
    PolicyAlias.objects.create(name="production", version=r18)

    def attempt(i: int):
        return policy_services.activate(
            alias_name="production",
            version_id=candidates[i].pk,
            expected_version_id=r18.pk,
            reason=f"admin {i}",
            actor=BOB,
        )

    results = run_concurrently(4, attempt)
    winners = [r for r in results if isinstance(r, policy_services.AliasChange)]
    assert len(winners) == 1
    assert all(isinstance(r, AliasMoved) for r in results if r not in winners)
    assert alias().version_id == winners[0].plan.to_version_id
    assert ChangeRecord.objects.filter(action="policy.activate").count() == 1


def test_rollback_keeps_the_lower_cap_clears_the_count_cache_and_cannot_repeat(policies, redis_db):
    activate_r19(policies)
    redis_db.set("tc:sha256:abc:tpl:deadbeef", 12)
    redis_db.set("unrelated:key", 1)
    with pytest.raises(AliasMoved):
        policy_services.rollback(
            alias_name="production", expected_version_id=policies["r18"].pk, reason="stale", actor=BOB
        )
    done = policy_services.rollback(
        alias_name="production",
        expected_version_id=policies["r19"].pk,
        reason="r19 misbehaves",
        actor=BOB,
        cache=RedisCountCache(redis_db),
    )
    back = alias()
    assert (back.version_id, back.previous_id) == (policies["r18"].pk, None)
    assert back.global_cap_floor == 50000  # min(60000 of r18, 50000 of r19)
    assert policy_services.effective_cap(back) == 50000
    assert done.caches_cleared == 1
    assert redis_db.get("tc:sha256:abc:tpl:deadbeef") is None
    assert redis_db.get("unrelated:key") == b"1"
    redis_db.delete("unrelated:key")
    with pytest.raises(NothingToRollBack):
        policy_services.rollback(
            alias_name="production", expected_version_id=policies["r18"].pk, reason="again", actor=BOB
        )
    record = ChangeRecord.objects.get(action="policy.rollback")
    assert record.before["version"] == policies["r19"].pk and record.after["version"] == policies["r18"].pk


def test_activate_and_roll_back_through_confirmation_pages(users, policies, redis_db):
    platform = login("platform")
    activate_url = reverse("admin:budgeting_policyversion_activate", args=[policies["r19"].pk])
    page = platform.get(activate_url).content.decode()
    assert "globalMaxInputTokens" in page and "60,000" in page and "50,000" in page
    assert alias().version_id == policies["r18"].pk  # a GET changes nothing
    response = platform.post(activate_url, {"reason": "roll out", "expected_version": policies["r18"].pk})
    assert response.status_code == 302
    assert alias().version_id == policies["r19"].pk
    rollback_url = reverse("admin:budgeting_policyalias_rollback", args=[alias().pk])
    page = platform.get(rollback_url).content.decode()
    assert "Roll back to r18" in page and "cleared" in page
    response = platform.post(
        rollback_url, {"reason": "bad", "expected_version": policies["r19"].pk}, follow=True
    )
    assert "rolled back to r18" in response.content.decode()
    assert alias().version_id == policies["r18"].pk
    history = platform.get(reverse("admin:budgeting_changerecord_changelist")).content.decode()
    assert "policy.activate" in history and "policy.rollback" in history


def test_a_refused_activation_says_the_version_is_already_active(users, policies):
    platform = login("platform")
    url = reverse("admin:budgeting_policyversion_activate", args=[policies["r19"].pk])
    PolicyAlias.objects.filter(name="production").update(version=policies["r19"])
    response = platform.post(url, {"reason": "late", "expected_version": policies["r18"].pk}, follow=True)
    html = response.content.decode()
    assert "r19 is already active as production" in html
    assert "Activate r19" not in html and "from r19 to r19" not in html
    assert response.redirect_chain[-1][0] == reverse(
        "admin:budgeting_policyversion_change", args=[policies["r19"].pk]
    )
    assert not ChangeRecord.objects.filter(action="policy.activate").exists()
    # Opening the page of the active version's activation says the same, instead of offering r19 -> r19.
    again = platform.get(url, follow=True).content.decode()
    assert "r19 is already active as production" in again and "Activate r19" not in again


def test_a_refused_activation_is_planned_again_from_where_the_alias_is_now(users, policies):
    r21 = PolicyVersion.objects.create(revision=21, state=PolicyState.VALIDATED, document=policy_document(21))
    platform = login("platform")
    url = reverse("admin:budgeting_policyversion_activate", args=[policies["r19"].pk])
    PolicyAlias.objects.filter(name="production").update(version=r21)
    html = platform.post(url, {"reason": "late", "expected_version": policies["r18"].pk}).content.decode()
    assert "moved by someone else" in html
    assert "production moves from r21 to r19" in html
    assert f'name="expected_version" value="{r21.pk}"' in html  # the CAS now expects what the page shows
    assert platform.post(url, {"reason": "now", "expected_version": r21.pk}).status_code == 302
    assert alias().version_id == policies["r19"].pk


def test_every_error_of_a_draft_is_listed_with_its_path(users, policies):
    doc = policy_document(21, ladder=["FULL", "TRUNCATE", "QUEUE_OR_REJECT"])
    doc["globalMaxInputTokens"] = 0
    doc["taskClasses"]["contract-review"]["rampPercent"] = 101
    doc["taskClasses"]["contract-review"]["bogus"] = True
    html = add_draft(login("platform"), 21, doc)
    for line in (
        "globalMaxInputTokens: must be between 1 and 100000000",
        "taskClasses.contract-review.ladder[1]: &quot;TRUNCATE&quot; is not one of FULL",
        "taskClasses.contract-review.rampPercent: must be between 0 and 100",
        "taskClasses.contract-review.bogus: unknown field",
    ):
        assert line in html, line
    assert not PolicyVersion.objects.filter(revision=21).exists()


def test_invalid_json_is_reported_with_its_line_and_column(users, policies):
    text = '{\n  "revision": 21,\n  "globalMaxInputTokens": ,\n}'
    html = add_draft(login("platform"), 21, text)
    assert "Not valid JSON: Expecting value at line 3, column 27." in html
    assert "&quot;globalMaxInputTokens&quot;: ," in html  # the text is kept for correcting


def test_the_editor_page_carries_the_schema_and_the_vendored_editor(users, policies):
    html = login("platform").get(reverse("admin:budgeting_policyversion_add")).content.decode()
    assert 'id="policy-schema"' in html and "data-policy-editor" in html
    assert "/static/policy/editor.js" in html
    assert reverse("admin:budgeting_policyversion_schema") in html
    editor = Path(settings.BASE_DIR, "budgeting", "static", "policy", "editor.js")
    assert editor.stat().st_size > 100_000 and "codemirror" in Path(editor.parent, "LICENSES.txt").read_text()
    # A validated version is shown in the same editor, read-only.
    shown = login("platform").get(reverse("admin:budgeting_policyversion_change", args=[policies["r18"].pk]))
    assert "data-policy-editor" in shown.content.decode() and "readonly" in shown.content.decode()


def test_the_schema_is_published_without_signing_in(db):
    response = Client().get(reverse("admin:budgeting_policyversion_schema"))
    assert response.status_code == 200
    assert response["Content-Type"] == "application/schema+json"
    assert response.json() == schema()


def test_after_a_rollback_the_alias_page_says_which_cap_is_in_force_and_why(users, policies, redis_db):
    activate_r19(policies)
    platform = login("platform")
    before = platform.get(reverse("admin:budgeting_policyalias_change", args=[alias().pk])).content.decode()
    assert "50,000 tokens: r19&#x27;s own globalMaxInputTokens." in before
    rollback_url = reverse("admin:budgeting_policyalias_rollback", args=[alias().pk])
    done = platform.post(rollback_url, {"reason": "bad", "expected_version": policies["r19"].pk}, follow=True)
    html = done.content.decode()
    explanation = "50,000 tokens: the lower cap of r19, kept when production was rolled back to r18 on "
    assert html.count(explanation) == 2  # the success message and the page itself
    assert "r18&#x27;s own cap is 60,000; the lower one stays in force until a version is activated." in html
    assert "global cap in force: 50,000 tokens: the lower cap of r19" in call_policy("list")


def call_policy(*args: str) -> str:
    out = StringIO()
    call_command("policy", *args, stdout=out)
    return out.getvalue()


def test_policy_check_lists_every_error_of_a_file(tmp_path):
    good = tmp_path / "good.json"
    good.write_text(json.dumps(policy_document(7)))
    assert "a valid policy document (r7)" in call_policy("check", str(good))
    bad = tmp_path / "bad.yaml"
    bad.write_text("revision: 7\nglobalMaxInputTokens: 0\ntaskClasses: {x: {inputCap: 1}}\n")
    out = StringIO()
    with pytest.raises(CommandError, match="error"):
        call_command("policy", "check", str(bad), stdout=out)
    assert "globalMaxInputTokens: must be between 1 and 100000000" in out.getvalue()
    assert "taskClasses.x.ladder: required field is missing" in out.getvalue()
    broken = tmp_path / "broken.json"
    broken.write_text('{"revision": 7,\n "x": [}')
    with pytest.raises(CommandError, match="line 2, column"):
        call_policy("check", str(broken))
