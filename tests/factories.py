"""factory_boy factories for the catalog and the ledger."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime

import factory

from budgeting.catalog.models import (
    ApiToken,
    ModelPool,
    ModelRevision,
    RolloutMode,
    ServiceClient,
    TaskClass,
    Tenant,
    Tokenizer,
    hash_token,
)
from ledger.models import CapacityAccount, Period, Scope
from ledger.periods import period_start_for


class TenantFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Tenant
        django_get_or_create = ("slug",)

    slug = factory.Sequence(lambda n: f"t-{n}")
    name = factory.LazyAttribute(lambda o: f"Tenant {o.slug}")
    rollout_mode = RolloutMode.ENFORCE


class TaskClassFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = TaskClass
        django_get_or_create = ("slug",)

    slug = factory.Sequence(lambda n: f"task-{n}")
    max_output_cap = 1000
    input_cap = 20000


class ModelPoolFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = ModelPool
        django_get_or_create = ("slug",)

    slug = factory.Sequence(lambda n: f"pool-{n}")
    region = "eu"


class TokenizerFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Tokenizer
        django_get_or_create = ("name",)

    name = "deepseek-v3"
    family = "byte-level-bpe"
    file_name = "deepseek_v3.json"
    digest = factory.LazyAttribute(lambda o: "sha256:" + hashlib.sha256(o.name.encode()).hexdigest())


class ModelRevisionFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = ModelRevision
        django_get_or_create = ("name",)
        skip_postgeneration_save = True

    name = factory.Sequence(lambda n: f"model-{n}@2026-07-01")
    tokenizer = factory.SubFactory(TokenizerFactory)
    context_window = 32768
    max_output = 8192
    template_family = "deepseek"
    capabilities = ["tools", "json_schema", "vision"]
    data_residency = "eu"

    @factory.post_generation
    def pools(self, create: bool, extracted: list[ModelPool] | None, **kwargs: object) -> None:
        if create and extracted:
            self.pools.set(extracted)


class ServiceClientFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = ServiceClient
        skip_postgeneration_save = True

    name = factory.Sequence(lambda n: f"gateway-{n}")

    @factory.post_generation
    def tenants(self, create: bool, extracted: list[Tenant] | None, **kwargs: object) -> None:
        if create and extracted:
            self.tenants.set(extracted)


def issue_token(client: ServiceClient, raw: str) -> str:
    ApiToken.objects.create(client=client, token_hash=hash_token(raw), prefix=raw[:8])
    return raw


class AccountFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = CapacityAccount

    scope = Scope.TENANT
    period = Period.MONTH
    period_start = factory.LazyAttribute(lambda o: period_start_for(o.period, datetime.now(UTC)))
