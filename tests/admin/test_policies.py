"""Platform's policy work: drafts validated field by field, diffs, activation and rollback by compare-and-swap
(the rollback keeps the lower cap and clears the count cache), all through confirmation pages."""

from __future__ import annotations

import json

import pytest
from django.urls import reverse
from django.utils import timezone

from budgeting.admission.count_cache import RedisCountCache
from budgeting.catalog import policies as policy_services
from budgeting.catalog.changes import Actor
from budgeting.catalog.errors import Conflict
from budgeting.catalog.models import ChangeRecord, PolicyAlias, PolicyState, PolicyVersion
from budgeting.catalog.policies import AliasMoved, NothingToRollBack, NotValidated
from tests.admin.conftest import login, policy_document
from tests.ledger.helpers import run_concurrently

pytestmark = pytest.mark.django_db
BOB = Actor(user_id=None, username="bob")


def alias() -> PolicyAlias:
    return PolicyAlias.objects.select_related("version", "previous").get(name="production")


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
    assert "Enter a valid JSON" in add_draft(platform, 21, "{")
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
    assert (lines["globalMaxInputTokens"].old, lines["globalMaxInputTokens"].new) == ("60000", "50000")
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
    policy_services.activate(
        alias_name="production",
        version_id=policies["r19"].pk,
        expected_version_id=policies["r18"].pk,
        reason="r19",
        actor=BOB,
    )
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
    assert "globalMaxInputTokens" in page and "60000" in page and "50000" in page
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


def test_a_stale_confirmation_page_changes_nothing(users, policies):
    platform = login("platform")
    url = reverse("admin:budgeting_policyversion_activate", args=[policies["r19"].pk])
    PolicyAlias.objects.filter(name="production").update(version=policies["r19"])
    response = platform.post(url, {"reason": "late", "expected_version": policies["r18"].pk}, follow=True)
    assert "moved by someone else" in response.content.decode()
    assert not ChangeRecord.objects.filter(action="policy.activate").exists()
