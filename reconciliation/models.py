"""Billing imports and their findings (filled by the reconciliation issue)."""
