"""The policy command: alias compare-and-swap, rollback with the lower cap kept and caches cleared."""

from __future__ import annotations

import copy
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from budgeting.catalog.models import PolicyAlias, PolicyVersion
from budgeting.provisioning.apply import apply_config
from budgeting.provisioning.source import load_file

pytestmark = pytest.mark.django_db

DEMO = Path(__file__).resolve().parents[2] / "budgeting" / "demo" / "demo.yaml"


@pytest.fixture
def versions(redis_db):
    doc = load_file(DEMO)
    v19 = copy.deepcopy(doc["policies"]["versions"][0])
    v19["revision"] = 19
    v19["document"]["revision"] = 19
    v19["document"]["globalMaxInputTokens"] = 90000
    v19["note"] = "raise the global cap"
    doc["policies"]["versions"].append(v19)
    apply_config(doc)
    return redis_db


def run(*args: str) -> str:
    out = StringIO()
    call_command("policy", *args, stdout=out)
    return out.getvalue()


def test_activate_with_a_stale_expected_version_fails(versions):
    with pytest.raises(CommandError, match="POLICY_ALIAS_MOVED"):
        run("activate", "19", "--expected", "19", "--reason", "stale")
    assert PolicyAlias.objects.get(name="production").version.revision == 18


def test_activate_then_rollback_keeps_the_lower_cap_and_clears_length_caches(versions):
    out = run("activate", "19", "--expected", "18", "--reason", "raise the cap")
    assert "r18 -> r19" in out
    alias = PolicyAlias.objects.get(name="production")
    assert alias.version.revision == 19
    versions.set("tc:sha256:dead:deepseek/2:abc", 7)
    out = run("rollback", "--expected", "19", "--reason", "incident 42")
    alias.refresh_from_db()
    assert alias.version.revision == 18
    assert alias.global_cap_floor == 60000, "the lower of the two caps is kept"
    assert "length caches cleared" in out
    assert versions.get("tc:sha256:dead:deepseek/2:abc") is None
    listing = run("list")
    assert "r18" in listing and "<- production" in listing


def test_rollback_with_a_stale_expected_version_fails(versions):
    run("activate", "19", "--expected", "18", "--reason", "raise")
    with pytest.raises(CommandError, match="POLICY_ALIAS_MOVED"):
        run("rollback", "--expected", "18", "--reason", "stale")
    assert PolicyAlias.objects.get(name="production").version.revision == 19


def test_validated_versions_are_immutable(versions):
    from django.db import DatabaseError, transaction

    version = PolicyVersion.objects.get(revision=18)
    version.document = {**version.document, "globalMaxInputTokens": 1}
    with pytest.raises(DatabaseError), transaction.atomic():
        version.save()
