"""DATABASE_URL becomes Django's DATABASES entry: prepared statements on (the reserving statement is prepared
once per connection) unless a pooler in transaction mode needs them off."""

from __future__ import annotations

import pytest
from django.core.exceptions import ImproperlyConfigured

from budgeting.settings import database_from_url


def test_prepared_statements_are_on_by_default_and_can_be_turned_off():
    on = database_from_url("postgres://app@db:5432/tokenbudget")
    assert on["OPTIONS"] == {"connect_timeout": "3", "prepare_threshold": 1}
    off = database_from_url("postgres://app@db:6432/tokenbudget?prepare_threshold=none&sslmode=require")
    assert off["OPTIONS"] == {"connect_timeout": "3", "prepare_threshold": None, "sslmode": "require"}


def test_a_url_without_a_database_name_is_refused():
    with pytest.raises(ImproperlyConfigured, match="names no database"):
        database_from_url("postgres://app@db:5432/")
