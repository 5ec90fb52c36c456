"""Domain errors: what went wrong, as a stable code with a detail and data a caller can act on.

They carry no HTTP: ``budgeting.api.problems`` is the one place that turns them into problem+json responses
(and the admin shows their detail as a message). ``retry_after`` is a domain fact (when trying again can
help), which the API sends as ``Retry-After``.
"""

from __future__ import annotations

from typing import Any


class DomainError(Exception):
    """An error a caller can act on: a stable ``code``, a human ``title`` and ``detail``, and data."""

    code = "ERROR"
    title = "Error"
    retry_after: int | None = None

    def __init__(
        self, detail: str = "", *, code: str | None = None, retry_after: int | None = None, **extra: Any
    ) -> None:
        super().__init__(detail or self.title)
        self.detail = detail or self.title
        if code is not None:
            self.code = code
        if retry_after is not None:
            self.retry_after = retry_after
        self.extra = extra


class InvalidInput(DomainError):
    code = "INVALID_INPUT"
    title = "The request body is not valid"


class Unprocessable(DomainError):
    """Well-formed, but the request cannot be served as asked (no retry helps without changing it)."""

    code = "UNPROCESSABLE"
    title = "The request cannot be processed"


class NotFound(DomainError):
    code = "NOT_FOUND"
    title = "Not found"


class Conflict(DomainError):
    code = "CONFLICT"
    title = "Conflict with the current state"


class Unavailable(DomainError):
    code = "UNAVAILABLE"
    title = "Temporarily unavailable"
    retry_after = 5


class CapacityExhausted(DomainError):
    """Not enough capacity now; ``retry_after`` says when trying again may help."""

    code = "CAPACITY_EXHAUSTED"
    title = "Not enough capacity"


class InvalidChange(InvalidInput):
    code = "INVALID_CHANGE"
    title = "The change is not allowed"


class CatalogUnchecked(Exception):
    """A call made with an unchecked caller (``snapshot.unchecked()``) could not confirm the caller's catalog
    version with its first statement, before writing anything: the version moved, nothing was found to compare
    it with, or the statement failed (on a connection kept from an earlier request, say). The call must be
    made again with the catalog read. Never an answer (not a DomainError): whoever made the caller unchecked
    catches it."""
