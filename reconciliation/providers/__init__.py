"""Provider adapters the reconciler uses: outcome lookups, what each can prove, billing and usage imports.

``base`` holds the lookup protocol and the rule for when "not found" is proof; ``simulator``, ``openai_api``
and ``anthropic_api`` are the adapters; ``exports`` and ``usage`` parse billing exports and usage reports;
``registry`` builds the adapter a pool names. Django-free: the reconciler passes in what the database knows.
"""
