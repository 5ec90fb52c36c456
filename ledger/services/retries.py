"""Retrying a ledger transaction on deadlocks and serialization failures, a bounded number of times."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from django.db import OperationalError

from budgeting.db.cursor import sqlstate_of
from ledger.errors import (
    Contention,
)

logger = logging.getLogger(__name__)

# Deadlock detected, serialization failure: the transaction may succeed if run again.
RETRIED_SQLSTATES = frozenset({"40P01", "40001"})


T = TypeVar("T")


MAX_ATTEMPTS = 4


def with_retries(operation: Callable[[], T]) -> T:
    """Run a transaction, retrying deadlocks and serialization failures a bounded number of times.

    Raises Unavailable (503 with Retry-After) when every attempt failed that way.
    """
    for attempt in range(1, MAX_ATTEMPTS + 1):
        try:
            return operation()
        except OperationalError as exc:
            sqlstate = sqlstate_of(exc)
            if sqlstate not in RETRIED_SQLSTATES:
                raise
            logger.warning("retrying after %s (attempt %d)", sqlstate, attempt)
            time.sleep(0.005 * attempt)
    raise Contention("database contention; retry")
