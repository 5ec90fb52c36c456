"""Django's admin autodiscovery entry: the pages themselves live in ``budgeting/backoffice/``."""

from budgeting.backoffice import (
    account_admin,
    alert_admin,
    billing_admin,
    catalog_admin,
    changelog_admin,
    lockout_admin,
    manifest_admin,
    policy_admin,
    reservation_admin,
)

__all__ = [
    "account_admin",
    "alert_admin",
    "billing_admin",
    "catalog_admin",
    "changelog_admin",
    "lockout_admin",
    "manifest_admin",
    "policy_admin",
    "reservation_admin",
]
