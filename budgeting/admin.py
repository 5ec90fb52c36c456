"""Django's admin autodiscovery entry: the pages themselves live in ``budgeting/backoffice/``."""

from budgeting.backoffice import billing_admin, kit, ledger_admin

__all__ = ["billing_admin", "kit", "ledger_admin"]
