"""Fixtures of the admin tests: one staff user per role (the groups come from the data migration), a
catalog with accounts, and the scenario history."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Group, User
from django.test import Client

from budgeting.backoffice.roles import ANALYST, FINANCE, PLATFORM, sync_roles
from budgeting.catalog.models import PolicyAlias, PolicyState, PolicyVersion
from tests.admin.scenario import Scenario, populate
from tests.ledger.helpers import Catalog, catalog, pool_account, tenant_account

PASSWORD = "correct horse battery staple"
ROLES = (FINANCE, PLATFORM, ANALYST)


@pytest.fixture(autouse=True)
def fast_password_hashing(settings):
    """Hashing a password properly takes ~0.3 s by design; these tests sign in dozens of times."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def make_user(username: str, *, role: str | None = None, staff: bool = True, superuser: bool = False) -> User:
    user = User.objects.create_user(username, password=PASSWORD, is_staff=staff, is_superuser=superuser)
    if role:
        user.groups.add(Group.objects.get(name=role))
    return user


@pytest.fixture
def users(db) -> dict[str, User]:
    """finance, platform, analyst, a staff user with no role ("nobody") and a superuser ("root")."""
    # The data migration made the groups; a transactional test's flush empties them, so make sure again.
    sync_roles()
    made = {role: make_user(role, role=role) for role in ROLES}
    made["nobody"] = make_user("nobody")
    made["root"] = make_user("root", superuser=True)
    return made


def login(username: str) -> Client:
    client = Client()
    assert client.login(username=username, password=PASSWORD)
    return client


@pytest.fixture
def cat(db) -> Catalog:
    c = catalog(tenant_slug="t-19", pool_slug="eu-large", task_slug="contract-review")
    tenant_account(c, input_limit=1_000_000, output_limit=100_000, concurrency_limit=10)
    pool_account(c, input_limit=5_000_000, output_limit=500_000, concurrency_limit=50)
    return c


@pytest.fixture
def scenario(cat: Catalog) -> Scenario:
    return populate(tenant=cat.tenant, task_class=cat.task_class, pool=cat.pool, model=cat.model)


def policy_document(revision: int, cap: int = 60000, ladder: list[str] | None = None) -> dict:
    return {
        "revision": revision,
        "globalMaxInputTokens": cap,
        "taskClasses": {
            "contract-review": {
                "inputCap": 24000,
                "outputCap": 1600,
                "ladder": ladder or ["FULL", "DEDUP_EVIDENCE", "QUEUE_OR_REJECT"],
                "countingUnavailable": "REJECT",
                "rampPercent": 100,
            }
        },
    }


@pytest.fixture
def policies(db) -> dict[str, PolicyVersion]:
    """r18 active as production, r19 validated (lower cap), r20 a draft."""
    r18 = PolicyVersion.objects.create(revision=18, state=PolicyState.VALIDATED, document=policy_document(18))
    r19 = PolicyVersion.objects.create(
        revision=19, state=PolicyState.VALIDATED, document=policy_document(19, cap=50000)
    )
    r20 = PolicyVersion.objects.create(revision=20, document=policy_document(20, cap=40000))
    PolicyAlias.objects.create(name="production", version=r18)
    return {"r18": r18, "r19": r19, "r20": r20}
