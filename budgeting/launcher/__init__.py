"""The process launcher behind ``./platform`` (``python -m budgeting.launcher run|test [pytest args]``).

``./platform`` installs the virtualenv, then execs this package. DATABASE_URL and REDIS_URL from the
environment are used as given; for each one that is missing an embedded server is started (``embedded``).
``commands`` holds ``run`` and ``test``, ``processes`` the children and signals they share, ``supervisor``
restarts what dies. It is tooling, not domain code: nothing in the platform imports it.
"""
