"""Declarative provisioning: apply a JSON/YAML description of the catalog, accounts and policies."""
