"""A pool's provider settings shown and edited in the admin (never a key itself), and the billing import
offering every format the platform reads."""

from __future__ import annotations

from django.urls import reverse

from budgeting.catalog.models import ChangeRecord, ModelPool
from reconciliation.providers.exports import EXPORT_FORMAT_CHOICES
from tests.admin.conftest import login


def pool_form(pool: ModelPool, **changes: str) -> dict[str, str]:
    return {
        "slug": pool.slug,
        "region": pool.region,
        "provider": pool.provider,
        "adapter": pool.adapter,
        "provider_base_url": pool.provider_base_url,
        "api_key_env": pool.api_key_env,
        "admin_key_env": pool.admin_key_env,
        "max_call_seconds": str(pool.max_call_seconds),
        "change_reason": "move the pool to OpenAI",
        **changes,
    }


def test_the_pool_page_shows_and_edits_the_provider_adapter_and_key_variables(users, cat):
    platform = login("platform")
    listing = platform.get(reverse("admin:budgeting_modelpool_changelist")).content.decode()
    assert "Adapter" in listing and "Api key env" in listing
    url = reverse("admin:budgeting_modelpool_change", args=[cat.pool.pk])
    body = pool_form(
        cat.pool,
        provider="openai",
        adapter="openai",
        api_key_env="OPENAI_API_KEY",
        admin_key_env="OPENAI_ADMIN",
    )
    assert platform.post(url, body).status_code == 302
    pool = ModelPool.objects.get(pk=cat.pool.pk)
    assert (pool.provider, pool.adapter, pool.api_key_env, pool.admin_key_env) == (
        "openai",
        "openai",
        "OPENAI_API_KEY",
        "OPENAI_ADMIN",
    )
    entry = ChangeRecord.objects.get(action="modelpool.change")
    assert entry.after["adapter"] == "openai" and entry.reason == "move the pool to OpenAI"


def test_a_pasted_key_or_an_adapter_of_another_provider_is_refused_on_its_field(users, cat):
    platform = login("platform")
    url = reverse("admin:budgeting_modelpool_change", args=[cat.pool.pk])
    pasted = platform.post(url, pool_form(cat.pool, api_key_env="sk-proj-0123456789"))
    assert pasted.status_code == 200
    assert "never the key itself" in pasted.context["adminform"].form.errors["api_key_env"][0]
    assert "sk-proj-0123456789" not in str(ChangeRecord.objects.values_list("after", flat=True))
    mixed = platform.post(url, pool_form(cat.pool, provider="openai", adapter="anthropic-batches"))
    assert mixed.status_code == 200
    assert "does not belong to the pool's provider" in mixed.context["adminform"].form.errors["adapter"][0]
    assert ModelPool.objects.get(pk=cat.pool.pk).adapter == cat.pool.adapter


def test_the_billing_import_offers_every_format_the_platform_reads(users):
    html = login("finance").get(reverse("admin:reconciliation_billingimport_upload")).content.decode()
    for value, label in EXPORT_FORMAT_CHOICES:
        assert f'<option value="{value}"' in html and label in html, value


def test_the_price_list_shows_unit_prices_with_their_symbol_per_million_tokens():
    from decimal import Decimal

    from django.contrib import admin as django_admin

    from budgeting.catalog.models import Price

    price = Price(currency="USD", input_per_million=Decimal("0.27"), output_per_million=Decimal("1.1"))
    page = django_admin.site._registry[Price]
    assert page.input_price(price) == "$0.27"
    assert page.output_price(price) == "$1.10"
    assert page.input_price.short_description == "input per 1M tokens"
