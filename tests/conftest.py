"""Shared fixtures: the real PostgreSQL (pytest-django) and the real Redis at REDIS_URL."""

from __future__ import annotations

import pytest


@pytest.fixture
def redis_db():
    """The real Redis, flushed of this suite's count keys before and after."""
    from budgeting.admission.count_cache import redis_client

    client = redis_client()
    client.ping()
    for key in client.scan_iter(match="tc:*"):
        client.delete(key)
    yield client
    for key in client.scan_iter(match="tc:*"):
        client.delete(key)


@pytest.fixture(autouse=True)
def fresh_account_cache():
    """Each test provisions its own accounts; the per-process list of applicable accounts starts empty."""
    from ledger.services.accounts import forget_account_cache

    forget_account_cache()
    yield
    forget_account_cache()
