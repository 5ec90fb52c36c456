"""The catalog: tenants, task classes, pools, model revisions, tokenizers, service clients, policies."""
