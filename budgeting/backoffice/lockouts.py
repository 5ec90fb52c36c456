"""Admin sign-in lockouts (django-axes): after repeated failures a username, and separately an address, is
locked out for a while; each lockout is logged, and platform admins see and lift them under "Axes"."""

from __future__ import annotations

from typing import Any

import structlog
from axes.backends import AxesStandaloneBackend
from axes.signals import user_locked_out
from django.dispatch import receiver
from django.http import HttpRequest

logger = structlog.get_logger(__name__)


class LockoutBackend(AxesStandaloneBackend):
    """Refuses a sign-in from a locked-out username or address; the next backend checks the password.

    Only sign-ins that come with a request (the admin's login form) are guessing from the network; one
    without (``manage.py shell``, the test client's ``login``) has nothing to lock out by, so it passes on.
    """

    def authenticate(
        self,
        request: HttpRequest | None,
        username: str | None = None,
        password: str | None = None,
        **kwargs: Any,
    ) -> None:
        if request is None:
            return None
        return super().authenticate(request, username, password, **kwargs)


@receiver(user_locked_out)
def log_lockout(sender: Any, request: HttpRequest, username: str, ip_address: str, **kwargs: Any) -> None:
    logger.warning("admin sign-in locked out", username=username, ip_address=ip_address, path=request.path)
