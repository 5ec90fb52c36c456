"""The people's side: the admin kit, catalog, policy, ledger and billing pages, roles, reports."""
