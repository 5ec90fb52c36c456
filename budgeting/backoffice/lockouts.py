"""Admin sign-in lockouts (django-axes): after repeated failures a username, and separately an address, is
locked out for a while; each lockout is logged, and platform admins see them and lift one with a reason that
lands in the change log (pages: ``lockout_admin``)."""

from __future__ import annotations

from typing import Any

import structlog
from axes.backends import AxesStandaloneBackend
from axes.models import AccessAttempt
from axes.signals import user_locked_out
from django.db import transaction
from django.dispatch import receiver
from django.http import HttpRequest

from budgeting.catalog.changes import Actor, record_change, require_reason, snapshot

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


def lift_lockouts(*, attempt_ids: list[int], reason: str, actor: Actor) -> int:
    """Lift the lockouts of these access attempts (their failure counts are forgotten, so signing in works
    again), each in the change log with the username, address and failures it had. Returns how many were
    lifted. Raises InvalidChange (no reason).
    """
    reason = require_reason(reason)
    with transaction.atomic(durable=True):
        attempts = list(AccessAttempt.objects.filter(pk__in=attempt_ids).order_by("pk"))
        for attempt in attempts:
            record_change(
                actor=actor,
                action="axes.lift_lockout",
                target=attempt,
                before=snapshot(attempt, ("username", "ip_address", "failures_since_start", "attempt_time")),
                after=None,
                reason=reason,
            )
        AccessAttempt.objects.filter(pk__in=[a.pk for a in attempts]).delete()
    logger.info("admin sign-in lockouts lifted", count=len(attempts), by=actor.username)
    return len(attempts)
