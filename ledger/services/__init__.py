"""The ledger's write path: every balance change and every ledger entry is written here.

Each use case owns its ``transaction.atomic(durable=True)`` boundary, locks through ``ledger.locks`` in the
canonical order, applies a django-fsm transition on the freshly locked row, and moves balances only through
``postings``, which writes one ledger entry per account balance change.
"""
