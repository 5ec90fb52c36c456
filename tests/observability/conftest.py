"""Fixtures of the observability tests: the three roles' staff users, signed in quickly."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User

from budgeting.backoffice.roles import ANALYST, FINANCE, PLATFORM, sync_roles
from tests.admin.conftest import make_user


@pytest.fixture(autouse=True)
def fast_password_hashing(settings):
    """Hashing a password properly takes ~0.3 s by design; these tests sign in several times."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def users(db) -> dict[str, User]:
    sync_roles()
    return {role: make_user(role, role=role) for role in (FINANCE, PLATFORM, ANALYST)}
