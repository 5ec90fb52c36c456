"""Fixtures of the browser tests."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def fast_password_hashing(settings):
    """Hashing a password properly takes ~0.3 s by design; the test signs in three roles."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
