"""The ledger's domain errors, with the data a caller needs to act on them (no HTTP here)."""

from __future__ import annotations

from budgeting.catalog.errors import CapacityExhausted, Conflict, Unavailable, Unprocessable


class QuotaExceeded(CapacityExhausted):
    code = "QUOTA_EXCEEDED"
    title = "Not enough capacity on an account"


class PriceUnavailable(Unprocessable):
    code = "PRICE_UNAVAILABLE"
    title = "The model revision has no price in the currency of an account's spend limit"


class StaleFence(Conflict):
    code = "STALE_FENCE"
    title = "The lease fence is not the reservation's current fence"


class InvalidTransition(Conflict):
    code = "INVALID_TRANSITION"
    title = "The reservation's state does not allow this"


class UsageEventConflict(Conflict):
    code = "USAGE_EVENT_CONFLICT"
    title = "This usageEventId was already recorded with different amounts"


class PayloadChanged(Conflict):
    code = "PAYLOAD_CHANGED"
    title = "The dispatched payload is not the admitted one"


class IdempotencyConflict(Conflict):
    code = "IDEMPOTENCY_CONFLICT"
    title = "This Idempotency-Key was used for a different request"


class Contention(Unavailable):
    code = "CONTENTION"
    title = "Temporarily unavailable"
    retry_after = 1


class LimitsChanged(Conflict):
    code = "LIMITS_CHANGED"
    title = "The account's limits changed since the page was loaded"


class RowChanged(Exception):
    """A reservation read without a lock changed before its one write ran, so the write wrote nothing (an
    internal signal of the ledger's services: the call runs again under the row's lock; never an answer)."""


class HoldRefused(Exception):
    """A hold was refused by these accounts' limits and its statement wrote nothing (an internal signal of
    the ledger's services, turned into QuotaExceeded or a stay in the queue; never an answer)."""

    def __init__(self, account_ids: set[int]) -> None:
        super().__init__(sorted(account_ids))
        self.account_ids = account_ids
