"""WSGI entry point for the production server (gunicorn)."""

import os

from django.core.wsgi import get_wsgi_application

from budgeting.observability import tracing

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "budgeting.settings")

# Before Django loads its middleware: the Django instrumentation adds its own (only if tracing is configured).
tracing.start()
application = get_wsgi_application()
if os.environ.get("TB_BEHIND_FRONT") == "1":
    # Set by ./platform run when nginx fronts gunicorn (budgeting/launcher/front.py).
    from budgeting.launcher.front import client_address_from_front

    application = client_address_from_front(application)
