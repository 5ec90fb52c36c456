"""The migrations set the roles from lists frozen in ``budgeting/migrations/_roles.py``, never from the live
module: the last frozen lists are the live ones (a change to the roles needs a migration that freezes it), and
a migrated database's groups hold exactly them."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Group

from budgeting.backoffice.roles import ROLES
from budgeting.migrations import _roles

pytestmark = pytest.mark.django_db


def latest_frozen() -> dict[str, tuple[str, ...]]:
    frozen = sorted(name for name in vars(_roles) if name.startswith("ROLES_"))
    assert frozen, "no frozen role lists"
    return getattr(_roles, frozen[-1])


def test_the_last_frozen_role_lists_are_the_live_ones():
    assert {k: sorted(v) for k, v in latest_frozen().items()} == {k: sorted(v) for k, v in ROLES.items()}


def test_a_migrated_database_has_the_frozen_roles():
    for name, wanted in latest_frozen().items():
        group = Group.objects.get(name=name)
        held = {f"{p.content_type.app_label}.{p.codename}" for p in group.permissions.all()}
        assert held == set(wanted), name
