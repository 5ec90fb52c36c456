"""Reclaiming expired leases, settling unknown outcomes from authoritative evidence, and the reservations
no evidence can settle: flagged for a person, who resolves them here."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import QuerySet
from django_fsm import TransitionNotAllowed

from budgeting.catalog.changes import Actor, record_change, require_reason
from budgeting.catalog.errors import InvalidInput, NotFound
from budgeting.db.cursor import db_now as read_db_now
from ledger import locks
from ledger.errors import InvalidTransition
from ledger.models import (
    AFTER_DISPATCH,
    EntryKind,
    Reservation,
    State,
)
from ledger.services.postings import Postings, capture, held_account_ids, settle
from ledger.services.retries import with_retries

logger = logging.getLogger(__name__)


RECLAIMABLE = [State.RESERVED, State.DISPATCHED, State.RUNNING, State.PARTIALLY_SETTLED]


@dataclass(frozen=True)
class Claim:
    """A reservation taken over for a provider lookup, with what dispatch recorded about its call."""

    reservation_id: uuid.UUID
    fence: int
    provider_request_id: str
    pool_id: int
    provider_adapter: str
    provider_endpoint: str
    dispatched_at: datetime | None
    request_sent: str

    @classmethod
    def of(cls, reservation: Reservation) -> Claim:
        return cls(
            reservation.pk,
            reservation.fence,
            reservation.provider_request_id,
            reservation.model_pool_id,
            reservation.provider_adapter,
            reservation.provider_endpoint,
            reservation.dispatched_at,
            reservation.request_sent,
        )


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
        db_now = read_db_now()
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
        posts = Postings(reservation, held_account_ids(reservation))
        settle(
            posts,
            reservation.release_undispatched,
            reason="lease expired with no dispatch record",
            now=now,
            release_input=reservation.input_reserved,
        )
        reservation.failure_reason = "lease expired before dispatch"
        posts.flush()
        return reservation.pk
    reservation.freeze_unknown()
    reservation.lease_expires_at = db_now + timedelta(seconds=settings.LEASE_SECONDS)
    reservation.save()
    return Claim.of(reservation)


def claim_reconciling(*, limit: int = 100, min_age_seconds: int = 0) -> list[Claim]:
    """Take the next RECONCILING reservations for a provider lookup by raising their fences (SKIP LOCKED)."""
    with transaction.atomic(durable=True):
        db_now = read_db_now()
        rows = locks.lock_reconciling(db_now - timedelta(seconds=min_age_seconds), limit)
        claims = []
        for reservation in rows:
            reservation.fence += 1
            reservation.lease_expires_at = db_now + timedelta(seconds=settings.LEASE_SECONDS)
            reservation.save(update_fields=["fence", "lease_expires_at", "updated_at"])
            claims.append(Claim.of(reservation))
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
    cached_input_tokens: int | None = None
    """The part of the input billed at the cached-input price, when the evidence says."""


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
                db_now = read_db_now()
                if reservation.lease_expires_at is not None and reservation.lease_expires_at > db_now:
                    return None
            posts = Postings(reservation, held_account_ids(reservation))
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
                    # Usage was reported for it, so "never processed" contradicts our own record: keep it
                    # held, and stop looking it up — no later answer can settle a contradiction.
                    logger.error(
                        "reservation %s: not-processed evidence contradicts captured usage", reservation.pk
                    )
                    if reservation.state == State.RECONCILING:
                        _flag(
                            reservation,
                            f"{evidence.source} says never processed, but {reservation.captured} output "
                            f"tokens (+{reservation.overrun} overrun) were captured",
                            now,
                        )
                        reservation.save()
                    return None
                settle(
                    posts,
                    transition,
                    now=now,
                    reason=f"{evidence.source}: never processed",
                    refund_input=reservation.input_consumed,
                )
            else:
                _post_billed(posts, evidence, now=now)
                settle(
                    posts,
                    reservation.reconcile,
                    now=now,
                    reason=f"{evidence.source}: settled at billed usage",
                )
            posts.flush()
            return reservation

    return with_retries(attempt)


def _post_billed(posts: Postings, evidence: Evidence, *, now: datetime) -> None:
    """Bring captured output and consumed input to what was billed, with correcting entries."""
    reservation = posts.reservation
    if evidence.cached_input_tokens is not None:
        reservation.input_cached = evidence.cached_input_tokens
    recorded = reservation.captured + reservation.overrun
    delta = evidence.output_tokens - recorded
    if delta > 0:
        capture(
            posts,
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
        posts.move(
            EntryKind.CORRECTION,
            output_consumed=delta,
            output_reserved=captured_back,
            reason=f"{evidence.source}: billed {evidence.output_tokens} output, we had {recorded}",
        )
    if evidence.input_tokens != reservation.input_consumed:
        diff = evidence.input_tokens - reservation.input_consumed
        reservation.input_consumed = evidence.input_tokens
        reservation.input_reported = evidence.input_tokens
        posts.move(
            EntryKind.CORRECTION,
            input_consumed=diff,
            reason=f"{evidence.source}: billed {evidence.input_tokens} input",
        )


def _flag(reservation: Reservation, reason: str, now: datetime) -> None:
    """Mark a RECONCILING reservation as needing a person. Without a lease no reclaimer claims it again."""
    reservation.needs_person = reason[:300]
    reservation.needs_person_since = now
    reservation.lease_expires_at = None


def flag_for_person(*, reservation_id: uuid.UUID, fence: int, reason: str, now: datetime) -> bool:
    """Stop looking up a RECONCILING reservation that no lookup can settle, and show it to a person.

    Returns False when the claimer's fence moved on or the reservation is no longer RECONCILING.
    """
    with transaction.atomic(durable=True):
        reservation = locks.lock_reservation(reservation_id)
        if reservation is None or reservation.fence != fence or reservation.state != State.RECONCILING:
            return False
        _flag(reservation, reason, now)
        reservation.save(
            update_fields=["needs_person", "needs_person_since", "lease_expires_at", "updated_at"]
        )
        return True


def needing_a_person() -> QuerySet[Reservation]:
    """The backlog a person works through: RECONCILING reservations flagged as needing one, oldest first."""
    return (
        Reservation.objects.filter(state=State.RECONCILING)
        .exclude(needs_person="")
        .select_related("tenant", "model_pool")
        .order_by("needs_person_since", "pk")
    )


class Resolution(StrEnum):
    """What a person decided about a RECONCILING reservation."""

    AS_RECORDED = "AS_RECORDED"
    """It was processed as we recorded it: post what was captured, release the rest."""
    AS_BILLED = "AS_BILLED"
    """It was processed and billed at the amounts the person gives (from the provider's records)."""
    NOT_PROCESSED = "NOT_PROCESSED"
    """It was never processed: compensate what was captured, refund the input, release everything."""


def resolve_for_person(
    *,
    reservation_id: uuid.UUID,
    resolution: Resolution,
    actor: Actor,
    reason: str,
    now: datetime,
    input_tokens: int | None = None,
    output_tokens: int | None = None,
) -> Reservation:
    """Settle a RECONCILING reservation as a person decided, with compensating ledger entries and a change-log
    entry (before and after) in the same transaction.

    Raises NotFound, InvalidTransition (not RECONCILING), InvalidInput (no reason; AS_BILLED without both
    amounts, or amounts given for another resolution, or negative ones).
    """
    reason = require_reason(reason)
    amounts = (input_tokens, output_tokens)
    if resolution == Resolution.AS_BILLED:
        if input_tokens is None or output_tokens is None or input_tokens < 0 or output_tokens < 0:
            raise InvalidInput("a billed resolution needs non-negative input and output tokens")
    elif amounts != (None, None):
        raise InvalidInput(f"{resolution} takes no amounts")

    def attempt() -> Reservation:
        with transaction.atomic(durable=True):
            reservation = locks.lock_reservation(reservation_id)
            if reservation is None:
                raise NotFound("no such reservation")
            if reservation.state != State.RECONCILING:
                raise InvalidTransition(
                    f"only a RECONCILING reservation can be resolved, not one in state {reservation.state}",
                    state=reservation.state,
                    outcome=reservation.outcome or None,
                )
            before = _resolution_view(reservation)
            posts = Postings(reservation, held_account_ids(reservation))
            source = f"resolved by {actor.username} ({resolution}): {reason}"
            if resolution == Resolution.NOT_PROCESSED:
                _post_billed(posts, Evidence(EvidenceKind.COMPLETED, 0, 0, source), now=now)
                settle(posts, reservation.reconcile_unprocessed, now=now, reason=source)
            else:
                billed = (
                    Evidence(EvidenceKind.COMPLETED, input_tokens or 0, output_tokens or 0, source)
                    if resolution == Resolution.AS_BILLED
                    else Evidence(
                        EvidenceKind.COMPLETED,
                        reservation.input_consumed,
                        reservation.captured + reservation.overrun,
                        source,
                    )
                )
                _post_billed(posts, billed, now=now)
                settle(posts, reservation.reconcile, now=now, reason=source)
            posts.flush()
            record_change(
                actor=actor,
                action=f"reservation.resolve.{resolution.lower()}",
                target=reservation,
                before=before,
                after=_resolution_view(reservation),
                reason=reason,
            )
            return reservation

    return with_retries(attempt)


RESOLUTION_FIELDS = (
    "state",
    "outcome",
    "input_consumed",
    "captured",
    "overrun",
    "remaining",
    "released",
    "needs_person",
)


def _resolution_view(reservation: Reservation) -> dict[str, Any]:
    return {name: getattr(reservation, name) for name in RESOLUTION_FIELDS}
