"""Shared fixtures: the real PostgreSQL (pytest-django) and the real Redis at REDIS_URL."""

from __future__ import annotations

import pytest


@pytest.fixture
def redis_db():
    """The real Redis, flushed of this suite's count keys before and after."""
    from budgeting.admission.count_cache import count_cache, redis_client

    client = redis_client()
    client.ping()
    count_cache().forget_local()
    for key in client.scan_iter(match="tc:*"):
        client.delete(key)
    yield client
    count_cache().shared.discard_held()
    for key in client.scan_iter(match="tc:*"):
        client.delete(key)


@pytest.fixture(autouse=True)
def fresh_process_caches():
    """Each test provisions its own accounts and catalog: the per-process list of applicable accounts and the
    decision memo start empty."""
    from budgeting.admission.decision_memo import decision_memo
    from ledger.services.accounts import forget_account_cache

    forget_account_cache()
    decision_memo().clear()
    yield
    forget_account_cache()
    decision_memo().clear()


@pytest.fixture
def demo_api(redis_db):
    """A client of the demo gateway, with the demo configuration provisioned."""
    from rest_framework.test import APIClient

    from budgeting.provisioning.apply import apply_config
    from budgeting.provisioning.source import load_file
    from tests.demo import DEMO, DEMO_TOKEN

    apply_config(load_file(DEMO))
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {DEMO_TOKEN}")
    return client
