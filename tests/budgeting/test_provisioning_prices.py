"""Provisioning's price table and a pool's provider settings: read with field-named errors, planned and
applied like every other catalog object (change log, people's edits kept)."""

from __future__ import annotations

import copy
from decimal import Decimal
from io import StringIO
from pathlib import Path

import pytest
import yaml
from django.core.management import call_command

from budgeting.catalog.changes import Actor, record_change, snapshot
from budgeting.catalog.models import ChangeRecord, ModelPool, Price
from budgeting.provisioning.apply import apply_config, is_empty
from budgeting.provisioning.source import ProvisioningError, load_file

pytestmark = pytest.mark.django_db

DEMO = Path(__file__).resolve().parents[2] / "budgeting" / "demo" / "demo.yaml"
FINANCE = Actor(user_id=None, username="finance-anna")


def demo() -> dict:
    return copy.deepcopy(load_file(DEMO))


def provision(tmp_path: Path, doc: dict, *args: str) -> str:
    path = tmp_path / DEMO.name
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    out = StringIO()
    call_command("provision", str(path), "--yes", *args, stdout=out)
    return out.getvalue()


def people_edit(obj, reason: str, **values) -> None:
    """An edit as the admin makes it: saved and logged under a person's name."""
    before = snapshot(obj, tuple(values))
    for name, value in values.items():
        setattr(obj, name, value)
    obj.save(update_fields=list(values))
    record_change(
        actor=FINANCE,
        action=f"{obj._meta.model_name}.change",
        target=obj,
        before=before,
        after=snapshot(obj, tuple(values)),
        reason=reason,
    )


def test_the_demo_applies_its_prices_to_an_empty_database_and_applying_twice_changes_nothing():
    assert is_empty()
    first = apply_config(load_file(DEMO))
    assert first.changed
    prices = {
        p.model_revision.name: (
            p.effective_from.isoformat(),
            p.currency,
            p.input_per_million,
            p.output_per_million,
        )
        for p in Price.objects.select_related("model_revision")
    }
    assert prices == {
        "model@2026-07-01": ("2026-01-01T00:00:00+00:00", "USD", Decimal("0.27"), Decimal("1.10")),
        "small@2026-05-12": ("2026-01-01T00:00:00+00:00", "USD", Decimal("0.07"), Decimal("0.28")),
        "claude-legacy@2024-03-01": ("2026-01-01T00:00:00+00:00", "USD", Decimal("3.00"), Decimal("15.00")),
        "claude-sonnet-4-5@2025-09-29": (
            "2026-01-01T00:00:00+00:00",
            "USD",
            Decimal("3.00"),
            Decimal("15.00"),
        ),
        "gemini-2.5-flash@2025-06-17": ("2026-01-01T00:00:00+00:00", "USD", Decimal("0.30"), Decimal("2.50")),
    }
    assert ChangeRecord.objects.filter(
        action="price.add", actor_username__startswith="provision:"
    ).count() == len(prices)
    second = apply_config(load_file(DEMO))
    assert not second.changed, second.summary()
    assert not is_empty()


def test_a_price_the_file_changes_is_planned_field_by_field_and_logged(tmp_path):
    provision(tmp_path, demo())
    doc = demo()
    doc["prices"][0]["outputPerMillion"] = 1.25
    out = provision(tmp_path, doc)
    assert "~ price model@2026-07-01 from 2026-01-01T00:00:00Z" in out
    assert 'outputPerMillion: "1.100000" -> "1.250000"' in out
    price = Price.objects.get(model_revision__name="model@2026-07-01")
    assert price.output_per_million == Decimal("1.25")
    entry = ChangeRecord.objects.filter(action="price.change").get()
    assert (entry.before, entry.after) == (
        {"output_per_million": "1.100000"},
        {"output_per_million": "1.250000"},
    )
    assert provision(tmp_path, doc).splitlines()[-1].startswith("no changes; ")


def test_a_price_people_changed_is_kept_unless_forced(tmp_path):
    provision(tmp_path, demo())
    price = Price.objects.get(model_revision__name="small@2026-05-12")
    people_edit(price, "negotiated discount", input_per_million=Decimal("0.05"))
    out = provision(tmp_path, demo())
    assert 'inputPerMillion: kept "0.050000" (file: "0.070000"), changed by finance-anna' in out
    assert Price.objects.get(pk=price.pk).input_per_million == Decimal("0.05")
    provision(tmp_path, demo(), "--force")
    assert Price.objects.get(pk=price.pk).input_per_million == Decimal("0.07")


@pytest.mark.parametrize(
    ("price", "path"),
    [
        ({"modelRevision": "nope@1"}, "prices[0].modelRevision"),
        ({"effectiveFrom": "2026-01-01T00:00:00"}, "prices[0].effectiveFrom"),
        ({"effectiveFrom": "first of January"}, "prices[0].effectiveFrom"),
        ({"currency": "usd"}, "prices[0].currency"),
        ({"inputPerMillion": "-1"}, "prices[0].inputPerMillion"),
        ({"inputPerMillion": "cheap"}, "prices[0].inputPerMillion"),
        ({"outputPerMillion": "0.0000001"}, "prices[0].outputPerMillion"),
        ({"outputPerMillion": "123456789"}, "prices[0].outputPerMillion"),
        ({"outputPerMillion": True}, "prices[0].outputPerMillion"),
        ({"discount": "10%"}, "prices[0].discount"),
    ],
)
def test_an_invalid_price_names_its_field_and_applies_nothing(price, path):
    doc = demo()
    doc["prices"][0].update(price)
    with pytest.raises(ProvisioningError) as err:
        apply_config(doc)
    assert err.value.path == path, err.value
    assert is_empty()


def test_the_same_price_twice_is_refused():
    doc = demo()
    doc["prices"].append(dict(doc["prices"][0], effectiveFrom="2026-01-01T01:00:00+01:00"))
    with pytest.raises(ProvisioningError, match="described twice"):
        apply_config(doc)


def test_a_pool_names_its_provider_adapter_and_key_variables():
    doc = demo()
    doc["modelPools"][0].update(provider="openai", apiKeyEnv="OPENAI_API_KEY", adminKeyEnv="OPENAI_ADMIN_KEY")
    doc["modelPools"][1].update(provider="anthropic", adapter="anthropic-messages")
    apply_config(doc)
    pools = {p.slug: (p.provider, p.adapter, p.api_key_env, p.admin_key_env) for p in ModelPool.objects.all()}
    assert pools == {
        "eu-large": ("openai", "openai", "OPENAI_API_KEY", "OPENAI_ADMIN_KEY"),
        "us-small": ("anthropic", "anthropic-messages", "", ""),
        "eu-frontier": ("simulator", "simulator", "", ""),
        "us-frontier": ("simulator", "simulator", "", ""),
    }
    assert not apply_config(doc).changed


@pytest.mark.parametrize(
    ("pool", "path", "words"),
    [
        ({"provider": "azure"}, "modelPools[0].provider", "must be one of"),
        ({"provider": "anthropic"}, "modelPools[0].adapter", "is required"),
        (
            {"provider": "openai", "adapter": "anthropic-batches"},
            "modelPools[0].adapter",
            "not an adapter of",
        ),
        ({"adapter": "bedrock"}, "modelPools[0].adapter", "must be one of"),
        ({"apiKeyEnv": "sk-proj-abc123"}, "modelPools[0].apiKeyEnv", "never the key itself"),
        ({"adminKeyEnv": "A" * 65}, "modelPools[0].adminKeyEnv", "at most 64"),
    ],
)
def test_an_invalid_pool_provider_names_its_field(pool, path, words):
    doc = demo()
    doc["modelPools"][0].update(pool)
    with pytest.raises(ProvisioningError) as err:
        apply_config(doc)
    assert err.value.path == path and words in err.value.message, err.value
    assert is_empty()


def test_an_adapter_people_chose_keeps_the_provider_it_belongs_to(tmp_path):
    doc = demo()
    doc["modelPools"][1].update(provider="anthropic", adapter="anthropic-batches")
    provision(tmp_path, doc)
    people_edit(ModelPool.objects.get(slug="us-small"), "plain Messages calls", adapter="anthropic-messages")
    doc["modelPools"][1].update(provider="openai", adapter="openai")
    out = provision(tmp_path, doc)
    pool = ModelPool.objects.get(slug="us-small")
    assert (pool.provider, pool.adapter) == ("anthropic", "anthropic-messages")
    assert 'provider: kept "anthropic" (file: "openai"), kept with adapter, changed by finance-anna' in out
    provision(tmp_path, doc, "--force")
    pool.refresh_from_db()
    assert (pool.provider, pool.adapter) == ("openai", "openai")
