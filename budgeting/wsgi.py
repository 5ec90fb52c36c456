"""WSGI entry point for the production server (gunicorn)."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "budgeting.settings")

application = get_wsgi_application()
