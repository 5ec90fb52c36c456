"""Declarative provisioning: idempotent, validated, one transaction; tokens hashed."""

from __future__ import annotations

import copy
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from budgeting.catalog.models import ApiToken, ModelRevision, PolicyVersion, Tenant, Tokenizer, hash_token
from budgeting.provisioning.apply import ProvisioningError, apply_config, load_file
from budgeting.provisioning.policy_documents import validate_policy_document
from ledger.models import CapacityAccount

pytestmark = pytest.mark.django_db

DEMO = Path(__file__).resolve().parents[2] / "budgeting" / "demo" / "demo.yaml"


def apply(doc):
    return apply_config(doc, validate_policy=validate_policy_document)


def test_demo_applies_and_applying_twice_changes_nothing():
    first = apply(load_file(DEMO))
    assert first.changed
    assert Tenant.objects.count() == 3
    assert Tenant.objects.filter(internal=True).count() == 1
    assert Tenant.objects.filter(rollout_mode="SHADOW").count() == 1
    assert ModelRevision.objects.values("tokenizer").distinct().count() == 2, "two different real tokenizers"
    assert all(t.digest.startswith("sha256:") and len(t.digest) == 71 for t in Tokenizer.objects.all())
    assert CapacityAccount.objects.count() == 6
    second = apply(load_file(DEMO))
    assert not second.changed, second.summary()


def test_tokens_are_stored_hashed():
    apply(load_file(DEMO))
    token = ApiToken.objects.get()
    assert token.token_hash == hash_token("tb_demo_gateway_eu_0000000000000000")
    assert "tb_demo_gateway_eu_0000000000000000" not in token.token_hash


@pytest.mark.parametrize(
    ("mutate", "path"),
    [
        (lambda d: d["modelRevisions"][0].update(contextWindow=-1), "modelRevisions[0].contextWindow"),
        (lambda d: d["modelRevisions"][0].update(maxOutput=10**6), "modelRevisions[0].maxOutput"),
        (lambda d: d["modelRevisions"][0].update(tokenizer="nope"), "modelRevisions[0].tokenizer"),
        (lambda d: d["tenants"][0].update(rolloutMode="MAYBE"), "tenants[0].rolloutMode"),
        (lambda d: d["tenants"][0].update(surprise=1), "tenants[0].surprise"),
        (lambda d: d["accounts"][0].update(inputLimit="lots"), "accounts[0].inputLimit"),
        (lambda d: d["taskClasses"][0].update(maxOutputCap=True), "taskClasses[0].maxOutputCap"),
        (lambda d: d["tokenizers"][0].update(file="missing.json"), "tokenizers[0].file"),
        (
            lambda d: d["policies"]["versions"][0]["document"]["taskClasses"]["summarize"].update(
                ladder=["TRIM_EVIDENCE"]
            ),
            "policies.versions[0].document",
        ),
    ],
)
def test_an_invalid_file_names_the_field_and_applies_nothing(mutate, path):
    doc = copy.deepcopy(load_file(DEMO))
    mutate(doc)
    with pytest.raises(ProvisioningError) as err:
        apply(doc)
    assert err.value.path.startswith(path), err.value.path
    assert not Tenant.objects.exists()
    assert not Tokenizer.objects.exists()
    assert not PolicyVersion.objects.exists()


def test_command_reports_the_bad_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("tenants:\n  - {slug: t-1, rolloutMode: SOMETIMES}\n")
    with pytest.raises(CommandError, match=r"tenants\[0\]\.rolloutMode"):
        call_command("provision", str(bad))


def test_issue_and_revoke_token():
    apply(load_file(DEMO))
    out = StringIO()
    call_command("issue_token", "gateway-us", stdout=out)
    raw = out.getvalue().rsplit(" ", 1)[-1].strip()
    token = ApiToken.objects.get(token_hash=hash_token(raw))
    assert token.client.name == "gateway-us"
    call_command("issue_token", "gateway-us", "--revoke", raw[:8], stdout=StringIO())
    token.refresh_from_db()
    assert token.revoked_at is not None
