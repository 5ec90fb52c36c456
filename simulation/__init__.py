"""Development tooling: a provider simulator, realistic gateway traffic and `manage.py simulate`.

Nothing in production imports this package.
"""
