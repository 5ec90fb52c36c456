"""Provisioning never undoes what people changed since the file's last apply (unless forced, and then it says
so); what it changes in account limits and aliases goes through their own write paths."""

from __future__ import annotations

from datetime import timedelta
from io import StringIO
from pathlib import Path

import pytest
import yaml
from django.core.management import call_command
from django.utils import timezone

from budgeting.catalog.changes import Actor, record_change, snapshot
from budgeting.catalog.models import ChangeRecord, PolicyAlias, PolicyVersion, Tenant
from budgeting.catalog.policies import activate
from budgeting.provisioning.apply import PlanChanged, apply_plan
from budgeting.provisioning.document import read_document
from budgeting.provisioning.models import ProvisionedValue
from budgeting.provisioning.plan import make_plan
from budgeting.provisioning.source import load, load_file
from ledger.models import CapacityAccount
from ledger.services.limits import (
    end_temporary_increase,
    grant_temporary_increase,
    limits_in_force,
    set_account_limits,
)

pytestmark = pytest.mark.django_db

DEMO = Path(__file__).resolve().parents[2] / "budgeting" / "demo" / "demo.yaml"
FINANCE = Actor(user_id=None, username="finance-anna")


def provision(*args: str, path: Path = DEMO) -> str:
    out = StringIO()
    call_command("provision", str(path), "--yes", *args, stdout=out)
    return out.getvalue()


def write(tmp_path: Path, doc) -> Path:
    path = tmp_path / DEMO.name
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def t19() -> CapacityAccount:
    return CapacityAccount.objects.get(scope="TENANT", tenant__slug="t-19")


def limits(account: CapacityAccount) -> tuple[int | None, int | None, int | None]:
    return (account.input_limit, account.output_limit, account.concurrency_limit)


def finance_raises_t19_output_to(value: int) -> None:
    account = t19()
    set_account_limits(
        account_id=account.pk,
        input_limit=account.input_limit,
        output_limit=value,
        concurrency_limit=account.concurrency_limit,
        spend_limit=account.spend_limit,
        expected=limits_in_force(account),
        reason="Q3 contract",
        actor=FINANCE,
    )


def test_a_limit_finance_raised_survives_a_reapply_and_the_plan_says_it_was_kept():
    provision()
    finance_raises_t19_output_to(12_000_000)
    out = provision()
    assert t19().output_limit == 12_000_000
    assert "  = account TENANT t-19\n" in out
    assert "outputLimit: kept 12000000 (file: 10000000), changed by finance-anna at " in out
    assert "(account.limits: 'Q3 contract')" in out
    assert out.splitlines()[-1].startswith("no changes; 1 value people changed kept (--force overrides)")


def test_force_overrides_a_people_value_through_the_ledger_and_says_so():
    provision()
    finance_raises_t19_output_to(12_000_000)
    out = provision("--force")
    assert t19().output_limit == 10_000_000
    assert "outputLimit: 12000000 -> 10000000  OVERRIDES people's value, changed by finance-anna" in out
    assert "1 value people changed overridden (--force)" in out
    entry = ChangeRecord.objects.filter(action="account.limits").first()
    assert entry is not None and entry.actor_username.startswith("provision:demo.yaml@sha256:")
    assert (entry.before["output_limit"], entry.after["output_limit"]) == (12_000_000, 10_000_000)
    assert "--force overrides the value people set for outputLimit" in entry.reason
    assert provision().splitlines()[-1].startswith("no changes; "), "forced values are the file's again"


def test_a_file_change_reaches_the_fields_people_left_alone_and_only_those(tmp_path):
    provision()
    finance_raises_t19_output_to(12_000_000)
    doc = load_file(DEMO)
    doc["accounts"][1].update(inputLimit=120_000_000, outputLimit=11_000_000)
    out = provision(path=write(tmp_path, doc))
    assert limits(t19()) == (120_000_000, 12_000_000, 40)
    assert "inputLimit: 100000000 -> 120000000" in out
    assert "outputLimit: kept 12000000 (file: 11000000)" in out
    entry = ChangeRecord.objects.filter(action="account.limits").first()
    assert entry is not None and entry.actor_username.startswith("provision:")
    assert (entry.before["input_limit"], entry.after["input_limit"]) == (100_000_000, 120_000_000)


def test_an_active_temporary_increase_stays_in_force_and_rides_on_top_of_a_new_limit(tmp_path):
    provision()
    now = timezone.now()
    increase = grant_temporary_increase(
        account_id=t19().pk,
        input_tokens=0,
        output_tokens=500_000,
        concurrency=0,
        expires_at=now + timedelta(days=3),
        reason="launch week",
        actor=FINANCE,
        now=now,
    )
    assert provision().splitlines()[-1].startswith("no changes; ")
    assert t19().output_limit == 10_500_000
    doc = load_file(DEMO)
    doc["accounts"][1]["outputLimit"] = 12_000_000
    out = provision(path=write(tmp_path, doc))
    assert "outputLimit: 10000000 -> 12000000  (active temporary increases of 500000 stay on top)" in out
    assert t19().output_limit == 12_500_000
    end_temporary_increase(increase_id=increase.pk, reason="ended early", actor=FINANCE, now=now)
    assert t19().output_limit == 12_000_000
    assert provision(path=write(tmp_path, doc)).splitlines()[-1].startswith("no changes; ")


def test_a_temporary_spend_increase_rides_on_top_of_the_files_spend_limit(tmp_path):
    provision()

    def internal() -> CapacityAccount:
        return CapacityAccount.objects.get(scope="TENANT", tenant__slug="t-internal")

    assert internal().spend_limit == 500_000_000  # the demo's $500 a month
    now = timezone.now()
    increase = grant_temporary_increase(
        account_id=internal().pk,
        input_tokens=0,
        output_tokens=0,
        concurrency=0,
        spend=100_000_000,
        expires_at=now + timedelta(days=3),
        reason="launch week",
        actor=FINANCE,
        now=now,
    )
    assert provision().splitlines()[-1].startswith("no changes; ")
    assert internal().spend_limit == 600_000_000
    doc = load_file(DEMO)
    doc["accounts"][0]["spendLimit"] = "700"
    out = provision(path=write(tmp_path, doc))
    assert "spendLimit: 500000000 -> 700000000  (active temporary increases of 100000000 stay on top)" in out
    assert internal().spend_limit == 800_000_000
    end_temporary_increase(increase_id=increase.pk, reason="ended early", actor=FINANCE, now=now)
    assert internal().spend_limit == 700_000_000


def test_a_catalog_edit_in_the_admin_is_kept_and_named(tmp_path):
    provision()
    tenant = Tenant.objects.get(slug="t-20")
    before = snapshot(tenant)
    tenant.rollout_mode = "ENFORCE"
    tenant.save()
    record_change(
        actor=FINANCE,
        action="tenant.change",
        target=tenant,
        before=before,
        after=snapshot(tenant),
        reason="go",
    )
    doc = load_file(DEMO)
    doc["tenants"][2]["name"] = "Globex"
    out = provision(path=write(tmp_path, doc))
    tenant.refresh_from_db()
    assert (tenant.name, tenant.rollout_mode) == ("Globex", "ENFORCE")
    assert '  ~ tenant t-20\n      name: "Globex Support" -> "Globex"\n' in out
    assert 'rolloutMode: kept "ENFORCE" (file: "SHADOW"), changed by finance-anna' in out


def test_a_change_made_outside_the_change_log_is_kept_too():
    provision()
    Tenant.objects.filter(slug="t-20").update(name="renamed in SQL")
    out = provision()
    assert Tenant.objects.get(slug="t-20").name == "renamed in SQL"
    assert 'name: kept "renamed in SQL" (file: "Globex Support"), changed outside the change log' in out


def test_before_values_were_remembered_the_change_log_decides_whose_a_value_is():
    """A database provisioned before provisioning remembered its values: what the log shows people changing is
    kept, the rest is the file's."""
    provision()
    finance_raises_t19_output_to(12_000_000)
    CapacityAccount.objects.filter(pk=t19().pk).update(input_limit=1)
    ProvisionedValue.objects.all().delete()
    provision()
    assert limits(t19()) == (100_000_000, 12_000_000, 40)


def test_an_alias_moves_with_the_file_unless_people_moved_it(tmp_path):
    provision()
    doc = load_file(DEMO)
    v19 = yaml.safe_load(yaml.safe_dump(doc["policies"]["versions"][0]))
    v19["revision"] = v19["document"]["revision"] = 19
    doc["policies"]["versions"].append(v19)
    doc["policies"]["aliases"][0]["version"] = 19
    path = write(tmp_path, doc)
    out = provision("--dry-run", path=path)
    assert "  ~ policy alias production\n      version: 18 -> 19\n" in out
    provision(path=path)
    assert PolicyAlias.objects.get(name="production").version.revision == 19
    moved = ChangeRecord.objects.filter(action="policy.activate").first()
    assert moved is not None and moved.actor_username.startswith("provision:")
    v18 = PolicyVersion.objects.get(revision=18)
    activate(
        alias_name="production",
        version_id=v18.pk,
        expected_version_id=PolicyVersion.objects.get(revision=19).pk,
        reason="roll back by hand",
        actor=FINANCE,
    )
    out = provision(path=path)
    assert PolicyAlias.objects.get(name="production").version.revision == 18
    assert "version: kept 18 (file: 19), changed by finance-anna" in out


def test_a_plan_made_before_a_persons_edit_is_not_applied():
    provision()
    loaded = load(DEMO)
    doc = loaded.document
    doc["tenants"][2]["name"] = "Globex"
    now = timezone.now()
    plan = make_plan(read_document(doc, now=now), loaded.source, force=False)
    Tenant.objects.filter(slug="t-20").update(name="a person's name")
    with pytest.raises(PlanChanged):
        apply_plan(plan, now=now)
    assert Tenant.objects.get(slug="t-20").name == "a person's name"
