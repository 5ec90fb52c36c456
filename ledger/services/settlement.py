"""Reclaiming expired leases and settling unknown outcomes from authoritative evidence."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
from django_fsm import TransitionNotAllowed

from ledger import locks
from ledger.models import (
    AFTER_DISPATCH,
    EntryKind,
    Reservation,
    State,
)
from ledger.services.postings import apply, capture, held_account_ids, settle
from ledger.services.retries import with_retries

logger = logging.getLogger(__name__)


logger = logging.getLogger(__name__)


RECLAIMABLE = [State.RESERVED, State.DISPATCHED, State.RUNNING, State.PARTIALLY_SETTLED]


@dataclass(frozen=True)
class Claim:
    reservation_id: uuid.UUID
    fence: int
    provider_request_id: str
    pool_id: int


def claim_expired_leases(*, now: datetime, limit: int = 100) -> tuple[list[uuid.UUID], list[Claim]]:
    """Take over reservations whose lease expired, each by raising its fence (database clock, SKIP LOCKED).

    RESERVED with no dispatch record is released in full: the protocol writes the dispatch record before the
    provider call, so its absence proves the call was never sent. Dispatched ones are frozen in RECONCILING
    with nothing released, and returned as claims for a provider lookup. Returns (released ids, claims).
    Safe to run twice at once: a row another reclaimer holds is skipped, a row it already moved is not
    reclaimable any more. One reservation per transaction: releasing touches its accounts, and holding
    several reservations' accounts at once would break the canonical lock order.
    """
    released: list[uuid.UUID] = []
    claims: list[Claim] = []
    failed: list[uuid.UUID] = []
    for _ in range(limit):
        try:
            outcome = with_retries(lambda: _claim_one_expired(now, failed))
        except _ClaimFailed as error:
            # One bad row must not stop every later reclaim (the oldest is picked first): log it, skip it.
            logger.exception("reclaiming reservation %s failed", error.reservation_id)
            failed.append(error.reservation_id)
            continue
        if outcome is None:
            break
        if isinstance(outcome, Claim):
            claims.append(outcome)
        else:
            released.append(outcome)
    return released, claims


class _ClaimFailed(Exception):
    def __init__(self, reservation_id: uuid.UUID) -> None:
        super().__init__(str(reservation_id))
        self.reservation_id = reservation_id


def _claim_one_expired(now: datetime, skip: list[uuid.UUID]) -> Claim | uuid.UUID | None:
    with transaction.atomic(durable=True):
        db_now = locks.db_now()
        assert isinstance(db_now, datetime)
        expired = locks.lock_expired_leases(RECLAIMABLE, db_now, 1, exclude=skip)
        if not expired:
            return None
        reservation = expired[0]
        try:
            return _take_over(reservation, now, db_now)
        except (TransitionNotAllowed, IntegrityError) as error:
            raise _ClaimFailed(reservation.pk) from error


def _take_over(reservation: Reservation, now: datetime, db_now: datetime) -> Claim | uuid.UUID:
    reservation.fence += 1
    if reservation.state == State.RESERVED and reservation.dispatched_at is None:
        settle(
            reservation,
            reservation.release_undispatched,
            held_account_ids(reservation),
            reason="lease expired with no dispatch record",
            now=now,
            release_input=reservation.input_reserved,
        )
        reservation.failure_reason = "lease expired before dispatch"
        reservation.save()
        return reservation.pk
    reservation.freeze_unknown()
    reservation.lease_expires_at = db_now + timedelta(seconds=settings.LEASE_SECONDS)
    reservation.save()
    return Claim(
        reservation.pk, reservation.fence, reservation.provider_request_id, reservation.model_pool_id
    )


def claim_reconciling(*, limit: int = 100, min_age_seconds: int = 0) -> list[Claim]:
    """Take the next RECONCILING reservations for a provider lookup by raising their fences (SKIP LOCKED)."""
    with transaction.atomic(durable=True):
        db_now = locks.db_now()
        assert isinstance(db_now, datetime)
        rows = locks.lock_reconciling(db_now - timedelta(seconds=min_age_seconds), limit)
        claims = []
        for reservation in rows:
            reservation.fence += 1
            reservation.lease_expires_at = db_now + timedelta(seconds=settings.LEASE_SECONDS)
            reservation.save(update_fields=["fence", "lease_expires_at", "updated_at"])
            claims.append(
                Claim(
                    reservation.pk,
                    reservation.fence,
                    reservation.provider_request_id,
                    reservation.model_pool_id,
                )
            )
        return claims


class EvidenceKind:
    COMPLETED = "COMPLETED"
    NOT_PROCESSED = "NOT_PROCESSED"


@dataclass(frozen=True)
class Evidence:
    """Authoritative evidence about a dispatched call: the provider's lookup or a billing record."""

    kind: str
    input_tokens: int = 0
    output_tokens: int = 0
    source: str = "provider lookup"


def settle_from_evidence(
    *, reservation_id: uuid.UUID, fence: int | None, evidence: Evidence, now: datetime
) -> Reservation | None:
    """Settle a dispatched reservation from authoritative evidence: post billed usage and release the rest
    (outcome RECONCILED), or release in full with input refunded when it was never processed (RELEASED).

    ``fence`` is the claimer's fence (None for billing imports, which are authoritative whoever holds the
    lease). Returns None when the reservation is already settled or the fence moved on (another reclaimer).
    """

    def attempt() -> Reservation | None:
        with transaction.atomic(durable=True):
            reservation = locks.lock_reservation(reservation_id)
            if reservation is None or (fence is not None and reservation.fence != fence):
                return None
            if reservation.state not in {State.RECONCILING, *AFTER_DISPATCH}:
                return None
            if fence is None and reservation.state != State.RECONCILING:
                # A billing record may settle a dispatched call only once its gateway's lease has run out;
                # checked here, under the row lock, on the database clock.
                db_now = locks.db_now()
                assert isinstance(db_now, datetime)
                if reservation.lease_expires_at is not None and reservation.lease_expires_at > db_now:
                    return None
            account_ids = held_account_ids(reservation)
            if evidence.kind == EvidenceKind.NOT_PROCESSED:
                if reservation.state not in {State.RECONCILING, State.DISPATCHED}:
                    # Usage already started flowing: "never processed" contradicts our record; keep it held.
                    return None
                transition = (
                    reservation.reconcile_unprocessed
                    if reservation.state == State.RECONCILING
                    else reservation.release_unprocessed
                )
                if reservation.captured or reservation.overrun:
                    # Usage was reported for it, so "never processed" contradicts our own record: keep it.
                    logger.error(
                        "reservation %s: not-processed evidence contradicts captured usage", reservation.pk
                    )
                    return None
                settle(
                    reservation,
                    transition,
                    account_ids,
                    now=now,
                    reason=f"{evidence.source}: never processed",
                    refund_input=reservation.input_consumed,
                )
            else:
                _post_billed(reservation, account_ids, evidence, now=now)
                settle(
                    reservation,
                    reservation.reconcile,
                    account_ids,
                    now=now,
                    reason=f"{evidence.source}: settled at billed usage",
                )
            reservation.save()
            return reservation

    return with_retries(attempt)


def _post_billed(
    reservation: Reservation, account_ids: list[int], evidence: Evidence, *, now: datetime
) -> None:
    """Bring captured output and consumed input to what was billed, with correcting entries."""
    recorded = reservation.captured + reservation.overrun
    delta = evidence.output_tokens - recorded
    if delta > 0:
        capture(
            reservation,
            account_ids,
            usage_event_id=f"reconcile:{evidence.source}:{now.isoformat()}",
            output_tokens=delta,
            input_tokens=None,
            final=False,
        )
    elif delta < 0:
        over_back = min(-delta, reservation.overrun)
        captured_back = -delta - over_back
        reservation.overrun -= over_back
        reservation.captured -= captured_back
        reservation.remaining += captured_back
        apply(
            reservation,
            account_ids,
            EntryKind.CORRECTION,
            output_consumed=delta,
            output_reserved=captured_back,
            reason=f"{evidence.source}: billed {evidence.output_tokens} output, we had {recorded}",
        )
    if evidence.input_tokens != reservation.input_consumed:
        diff = evidence.input_tokens - reservation.input_consumed
        reservation.input_consumed = evidence.input_tokens
        reservation.input_reported = evidence.input_tokens
        apply(
            reservation,
            account_ids,
            EntryKind.CORRECTION,
            input_consumed=diff,
            reason=f"{evidence.source}: billed {evidence.input_tokens} input",
        )
