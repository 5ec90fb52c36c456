"""The gateway's calls on a reservation: dispatch, usage, top-up, cancel, fail, lease, outcome."""

from __future__ import annotations

import contextlib
import functools
import logging
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TypeVar

from django.conf import settings
from django.db import IntegrityError, InterfaceError, OperationalError, transaction
from django.utils import timezone

from budgeting.catalog.errors import CatalogUnchecked, Conflict, NotFound
from budgeting.db.rows import fetch_rows
from ledger import locks
from ledger.errors import (
    HoldRefused,
    InvalidTransition,
    PayloadChanged,
    RowChanged,
    StaleFence,
    UsageEventConflict,
)
from ledger.models import (
    CapacityAccount,
    EntryKind,
    Reservation,
    State,
    TopUp,
    UsageEvent,
)
from ledger.services import slots
from ledger.services.accounts import shortage
from ledger.services.admission import PROVIDER_ID_CONSTRAINT, provider_request_id_in_use
from ledger.services.postings import (
    Postings,
    capture,
    held_account_ids,
    hold_top_up,
    own_transaction,
    settle,
    top_up_cost,
)
from ledger.services.retries import with_retries

logger = logging.getLogger(__name__)


class RequestSent:
    YES = "yes"
    NO = "no"
    UNKNOWN = "unknown"


def _locked(
    reservation_id: uuid.UUID, tenant_ids: Iterable[int], fence: int, catalog_version: int | None = None
) -> Reservation:
    return _checked(locks.lock_reservation(reservation_id, tenant_ids), fence, catalog_version)


def _checked(reservation: Reservation | None, fence: int, catalog_version: int | None = None) -> Reservation:
    """The reservation read for a write, its fence checked. With ``catalog_version`` (an unchecked caller's:
    ``Caller.checked_version``), the read must have found that catalog version, before anything is written:
    CatalogUnchecked otherwise, and when nothing was found (the caller's tenants may be out of date) or the
    read failed (``_written``)."""
    if catalog_version is not None and (
        reservation is None or reservation.catalog_version != catalog_version  # type: ignore[attr-defined]
    ):
        raise CatalogUnchecked
    if reservation is None:
        raise NotFound("no such reservation")
    if fence != reservation.fence:
        raise StaleFence(
            f"fence {fence} is {'older than' if fence < reservation.fence else 'not'} the current fence",
            currentFence=reservation.fence,
        )
    return reservation


T = TypeVar("T")


@dataclass(frozen=True)
class Read:
    """A reservation read without a lock ahead of its write (``read_together``); ``row`` is None when it
    was not found."""

    row: Reservation | None


@contextlib.contextmanager
def _failed_read_unchecked(catalog_version: int | None) -> Iterator[None]:
    """A read that fails for an unchecked caller (``catalog_version``: see ``_checked``) is CatalogUnchecked:
    nothing has been written, and the call is made again after the catalog read."""
    try:
        yield
    except (OperationalError, InterfaceError) as error:
        if catalog_version is None:
            raise
        raise CatalogUnchecked from error


def read_together(
    reservation_ids: Sequence[uuid.UUID], tenant_ids: Iterable[int], catalog_version: int | None = None
) -> dict[uuid.UUID, Read]:
    """The first read of each write of a batch (``_written``'s), made for them all in one statement. With
    ``catalog_version`` (an unchecked caller's) the read must find that version before anything is written:
    CatalogUnchecked otherwise, and when nothing was found or the read failed (``_checked``); the batch's
    writes then need no check of their own."""
    with _failed_read_unchecked(catalog_version):
        found = locks.read_reservations(reservation_ids, tenant_ids)
    if catalog_version is not None and (
        not found or any(row.catalog_version != catalog_version for row in found.values())  # type: ignore[attr-defined]
    ):
        raise CatalogUnchecked
    return {rid: Read(found.get(rid)) for rid in reservation_ids}


def _written(
    reservation_id: uuid.UUID,
    tenant_ids: Iterable[int],
    fence: int,
    use_case: Callable[[Reservation, Postings], T],
    catalog_version: int | None = None,
    read: Read | None = None,
) -> T:
    """Run a use case whose write is ONE statement (``Postings.flush``): first on the row read without a
    lock, its write applying only to the row version it read — two statements that each commit themselves,
    no transaction and no lock held between them — and, when the row changed in between, again in a
    transaction under the row's lock. Either way the use case sees a committed state of the row and its write
    applies to that state only. ``catalog_version``: see ``_checked``. ``read``: the row read already
    (``read_together``), for the first attempt."""
    tenants = list(tenant_ids)
    ahead = [] if read is None else [read]

    def unlocked() -> T:
        with own_transaction():
            if ahead:
                found = ahead.pop().row
            else:
                with _failed_read_unchecked(catalog_version):
                    found = locks.read_reservation(reservation_id, tenants)
            reservation = _checked(found, fence, catalog_version)
            version = reservation.row_version  # type: ignore[attr-defined]
            posts = Postings(reservation, held_account_ids(reservation), unchanged_since=version)
            return use_case(reservation, posts)

    def locked() -> T:
        with transaction.atomic(durable=True):
            reservation = _locked(reservation_id, tenants, fence, catalog_version)
            return use_case(reservation, Postings(reservation, held_account_ids(reservation)))

    try:
        return with_retries(unlocked)
    except RowChanged:
        return with_retries(locked)


_REASON_LENGTH = Reservation._meta.get_field("failure_reason").max_length or 0


def _recorded(reason: str) -> str:
    """A failure reason as the reservation keeps it (the client's reason may fill the column alone)."""
    return reason[:_REASON_LENGTH]


def _failure_reasons(reason: str, request_sent: str, usage: Usage | None) -> set[str]:
    """What ``fail`` records as the failure reason for this report, in whichever state it came."""
    reasons = {f"failed before dispatch: {reason}", f"failed ({request_sent} sent): {reason}"}
    if request_sent == RequestSent.NO and usage is None:
        reasons.add(f"never processed: {reason}")
    return {_recorded(text) for text in reasons}


def _refuse(reservation: Reservation, action: str) -> InvalidTransition:
    return InvalidTransition(
        f"cannot {action} a reservation in state {reservation.state}",
        state=reservation.state,
        outcome=reservation.outcome or None,
    )


def dispatch(
    *,
    reservation_id: uuid.UUID,
    tenant_ids: Iterable[int],
    fence: int,
    provider_request_id: str,
    admitted_digest: str,
    now: datetime,
    catalog_version: int | None = None,
) -> Reservation:
    """Record the dispatch (before the provider call): input is posted as consumed, and the provider adapter
    and endpoint the pool names now are recorded, since only a lookup there can vouch for the call later.

    Repeating the same dispatch is a no-op. Raises PayloadChanged for another digest, StaleFence,
    InvalidTransition, NotFound, and Conflict PROVIDER_REQUEST_ID_IN_USE when another call of the same
    tenant has this providerRequestId (another tenant's use of an id is never observable).
    """

    def use_case(reservation: Reservation, posts: Postings) -> Reservation:
        if admitted_digest != reservation.admitted_digest:
            raise PayloadChanged(
                "admittedDigest differs from the admitted payload's digest",
                expected=reservation.admitted_digest,
            )
        if reservation.state != State.RESERVED:
            if reservation.provider_request_id == provider_request_id and reservation.dispatched_at:
                return reservation
            raise _refuse(reservation, "dispatch")
        reservation.dispatch(provider_request_id)
        # The adapter and endpoint the pool names now, read with the row
        # (``locks.lock_reservation``: no statement of their own).
        reservation.provider_adapter = reservation.pool_adapter  # type: ignore[attr-defined]
        reservation.provider_endpoint = reservation.pool_endpoint  # type: ignore[attr-defined]
        reservation.dispatched_at = now
        n = reservation.input_reserved
        posts.move(EntryKind.POST, input_reserved=-n, input_consumed=n, reason="dispatched")
        posts.flush()
        return reservation

    try:
        return _written(reservation_id, tenant_ids, fence, use_case, catalog_version)
    except IntegrityError as error:
        constraint = getattr(getattr(error.__cause__, "diag", None), "constraint_name", None)
        if constraint != PROVIDER_ID_CONSTRAINT:
            raise
        raise provider_request_id_in_use(provider_request_id) from None


class _AlreadyDone(Exception):
    """The reservation's state refuses the write: unless it is a repeat of one already recorded."""

    def __init__(self, reservation: Reservation) -> None:
        super().__init__(str(reservation.pk))
        self.reservation = reservation


@dataclass(frozen=True)
class Usage:
    usage_event_id: str
    output_tokens: int
    input_tokens: int | None
    final: bool
    cached_input_tokens: int | None = None


def record_usage(
    *,
    reservation_id: uuid.UUID,
    tenant_ids: Iterable[int],
    fence: int,
    usage: Usage,
    now: datetime,
    catalog_version: int | None = None,
    read: Read | None = None,
) -> tuple[Reservation, bool]:
    """Capture one usage delta, idempotent by usageEventId; a final event settles (COMPLETED). ``read``: the
    reservation read already (``read_together``).

    Returns (reservation, applied); applied is False for an exact replay. Raises UsageEventConflict,
    StaleFence, InvalidTransition, NotFound.
    """

    def use_case(reservation: Reservation, posts: Postings) -> tuple[Reservation, bool]:
        if reservation.state not in {State.DISPATCHED, State.RUNNING, State.PARTIALLY_SETTLED}:
            raise _AlreadyDone(reservation)
        capture(
            posts,
            usage_event_id=usage.usage_event_id,
            output_tokens=usage.output_tokens,
            input_tokens=usage.input_tokens,
            final=usage.final,
            cached_input_tokens=usage.cached_input_tokens,
        )
        if usage.final:
            settle(posts, reservation.complete, reason="final usage", now=now)
        elif reservation.state == State.DISPATCHED:
            reservation.start_running()
        # No look-up of the event id first: its unique index answers a repeat (one statement fewer).
        posts.flush()
        return reservation, True

    try:
        return _written(reservation_id, tenant_ids, fence, use_case, catalog_version, read)
    except (IntegrityError, _AlreadyDone) as outcome:
        earlier = UsageEvent.objects.filter(
            reservation_id=reservation_id,
            usage_event_id=usage.usage_event_id,
            reservation__tenant_id__in=list(tenant_ids),
        ).first()
        if earlier is None:
            if isinstance(outcome, _AlreadyDone):
                raise _refuse(outcome.reservation, "record usage on") from None
            raise
        if (earlier.output_tokens, earlier.input_tokens, earlier.final) != (
            usage.output_tokens,
            usage.input_tokens,
            usage.final,
        ):
            raise UsageEventConflict(
                f"usageEventId {usage.usage_event_id!r} was recorded with other amounts",
                recorded={
                    "outputTokens": earlier.output_tokens,
                    "inputTokens": earlier.input_tokens,
                    "final": earlier.final,
                },
            ) from None
        return earlier.reservation, False


def top_up(
    *,
    reservation_id: uuid.UUID,
    tenant_ids: Iterable[int],
    fence: int,
    top_up_id: str,
    output_tokens: int,
    now: datetime,
    catalog_version: int | None = None,
) -> tuple[Reservation, bool]:
    """Extend the output hold; idempotent by topUpId. Raises QuotaExceeded when an account is short."""

    def use_case(reservation: Reservation, posts: Postings) -> tuple[Reservation, bool]:
        if reservation.state not in {State.RESERVED, State.DISPATCHED, State.RUNNING}:
            raise _AlreadyDone(reservation)
        posts.insert(TopUp(reservation=reservation, top_up_id=top_up_id, output_tokens=output_tokens))
        money = hold_top_up(reservation, output_tokens)
        posts.move(EntryKind.TOP_UP, output_reserved=output_tokens, spend_reserved=money)
        # No look-up of the top-up id first: its unique index answers a repeat (one statement fewer).
        # On the row read without a lock, a refusal undoes the one statement (HoldRefused); under the lock,
        # raising it rolls back what the statement moved on the other accounts.
        held = posts.flush(within_limits=True)
        short = {a for a in posts.account_ids if a not in held}
        if short:
            raise HoldRefused(short)
        return reservation, True

    try:
        return _written(reservation_id, tenant_ids, fence, use_case, catalog_version)
    except HoldRefused as refused:
        # Read once the attempt is undone: inside a caller's transaction the refused statement aborted it.
        reservation = Reservation.objects.get(pk=reservation_id)
        raise shortage(
            CapacityAccount.objects.get(pk=min(refused.account_ids)),
            input_tokens=0,
            output_tokens=output_tokens,
            concurrency=0,
            spend=top_up_cost(reservation, output_tokens),
            currency=reservation.currency or None,
        ) from None
    except (IntegrityError, _AlreadyDone) as outcome:
        earlier = (
            TopUp.objects.select_related("reservation")
            .filter(
                reservation_id=reservation_id,
                top_up_id=top_up_id,
                reservation__tenant_id__in=list(tenant_ids),
            )
            .first()
        )
        if earlier is None:
            if isinstance(outcome, _AlreadyDone):
                raise _refuse(outcome.reservation, "top up") from None
            raise
        if earlier.output_tokens != output_tokens:
            raise Conflict(
                f"topUpId {top_up_id!r} was recorded with another amount",
                code="TOP_UP_CONFLICT",
                recorded=earlier.output_tokens,
            ) from None
        return earlier.reservation, False


def cancel(
    *,
    reservation_id: uuid.UUID,
    tenant_ids: Iterable[int],
    fence: int,
    now: datetime,
    catalog_version: int | None = None,
) -> Reservation:
    """Before dispatch: release everything. After: settle what was consumed, keep the rest held."""

    def use_case(reservation: Reservation, posts: Postings) -> Reservation:
        if reservation.state == State.RESERVED:
            settle(
                posts,
                reservation.release_undispatched,
                reason="cancelled before dispatch",
                now=now,
                release_input=reservation.input_reserved,
            )
            reservation.failure_reason = "cancelled"
        elif reservation.state in {State.DISPATCHED, State.RUNNING}:
            reservation.settle_partially("cancelled after dispatch")
            # The gateway cancels once it closed the provider connection: the call stopped, so its
            # slot goes now (SPEC §5); what the provider produced past the usage posted stays held.
            slots.free_slot(posts, "cancelled after dispatch: the gateway closed the call")
        elif reservation.state == State.PROPOSED:
            reservation.reject_queued("cancelled while queued")
        elif reservation.failure_reason.startswith("cancelled"):
            return reservation
        else:
            raise _refuse(reservation, "cancel")
        posts.flush()
        return reservation

    return _written(reservation_id, tenant_ids, fence, use_case, catalog_version)


def fail(
    *,
    reservation_id: uuid.UUID,
    tenant_ids: Iterable[int],
    fence: int,
    reason: str,
    request_sent: str,
    usage: Usage | None,
    now: datetime,
    catalog_version: int | None = None,
) -> Reservation:
    """A provider call failed. Proof of non-processing releases in full; otherwise settle what was incurred.

    ``request_sent`` is RequestSent.NO only with proof (connection refused before any byte was sent). A
    ``usage`` event already recorded with the same amounts is not captured again; with other amounts it is a
    UsageEventConflict.
    """

    def use_case(reservation: Reservation, posts: Postings, *, recorded: bool) -> Reservation:
        if reservation.state == State.RESERVED:
            settle(
                posts,
                reservation.release_undispatched,
                reason=f"failed before dispatch: {reason}",
                now=now,
                release_input=reservation.input_reserved,
            )
            reservation.failure_reason = _recorded(f"failed before dispatch: {reason}")
        elif reservation.state == State.DISPATCHED and request_sent == RequestSent.NO and usage is None:
            settle(
                posts,
                reservation.release_unprocessed,
                reason=f"never processed: {reason}",
                now=now,
                refund_input=reservation.input_consumed,
            )
            reservation.failure_reason = _recorded(f"never processed: {reason}")
        elif reservation.state in {State.DISPATCHED, State.RUNNING}:
            if usage is not None and not recorded:
                # No look-up of the event id first: its unique index answers a repeat (one statement fewer).
                capture(
                    posts,
                    usage_event_id=usage.usage_event_id,
                    output_tokens=usage.output_tokens,
                    input_tokens=usage.input_tokens,
                    final=False,
                )
            reservation.settle_partially(_recorded(f"failed ({request_sent} sent): {reason}"))
            # A later "not found" from the provider cannot prove non-processing against this report.
            reservation.request_sent = request_sent
            if request_sent == RequestSent.YES:
                # The provider answered (an error, a cut stream) and the gateway closed the call: it stopped,
                # so its slot goes now (SPEC §5). Sent-or-not unknown may still run: the reclaimer decides.
                slots.free_slot(posts, "failed after dispatch: the provider call ended")
        elif reservation.state in {
            State.PARTIALLY_SETTLED,
            State.SETTLED,
        } and reservation.failure_reason.startswith(("failed", "never processed")):
            if reservation.failure_reason not in _failure_reasons(reason, request_sent, usage):
                # Not this call's repeat: another report of the failure (say, the request was sent after
                # all) would be lost if it were answered as one.
                raise InvalidTransition(
                    f"the reservation already failed as {reservation.failure_reason!r}",
                    state=reservation.state,
                    outcome=reservation.outcome or None,
                )
            return reservation
        else:
            raise _refuse(reservation, "fail")
        posts.flush()
        return reservation

    tenants = list(tenant_ids)
    try:
        return _written(
            reservation_id, tenants, fence, functools.partial(use_case, recorded=False), catalog_version
        )
    except IntegrityError:
        if usage is None:
            raise
        earlier = UsageEvent.objects.filter(
            reservation_id=reservation_id,
            usage_event_id=usage.usage_event_id,
            reservation__tenant_id__in=tenants,
        ).first()
        if earlier is None:
            raise
        if (earlier.output_tokens, earlier.input_tokens) != (usage.output_tokens, usage.input_tokens):
            raise UsageEventConflict(
                f"usageEventId {usage.usage_event_id!r} was recorded with other amounts",
                recorded={"outputTokens": earlier.output_tokens, "inputTokens": earlier.input_tokens},
            ) from None
    return _written(
        reservation_id, tenants, fence, functools.partial(use_case, recorded=True), catalog_version
    )


# The columns a lifecycle answer shows (``ledger.selectors.lifecycle_answer``), read back by the renewal.
_ANSWERED = (
    "id, state, outcome, fence, lease_expires_at, input_reserved, input_consumed, input_reported, "
    "output_reserved, top_ups, captured, remaining, released, overrun, concurrency_held, "
    "provider_request_id, failure_reason"
)
_RENEWABLE = [State.RESERVED, State.DISPATCHED, State.RUNNING, State.PARTIALLY_SETTLED]
# One statement that commits itself: the fence and the state are the UPDATE's own conditions (the row lock it
# takes is the one a locked read would take), the expiry is measured on the database clock.
_RENEW_SQL = f"""
UPDATE ledger_reservation
   SET lease_expires_at = clock_timestamp() + %s::int * interval '1 second', updated_at = %s
 WHERE id = %s AND tenant_id = ANY(%s::bigint[]) AND fence = %s AND state = ANY(%s::text[])
RETURNING {_ANSWERED}
"""


def renew_lease(*, reservation_id: uuid.UUID, tenant_ids: Iterable[int], fence: int) -> Reservation:
    """Push the lease expiry out by LEASE_SECONDS from the database clock: one statement when the fence is
    current and the state renewable. Raises NotFound, StaleFence, or InvalidTransition (settled, rejected,
    queued or reconciling)."""
    renewed = fetch_rows(
        Reservation,
        _RENEW_SQL,
        [
            settings.LEASE_SECONDS,
            timezone.now(),
            reservation_id,
            list(tenant_ids),
            fence,
            [str(state) for state in _RENEWABLE],
        ],
    )
    if renewed:
        return renewed[0]
    # Why not: the locked row says (a reservation that became renewable since is renewed here).
    with transaction.atomic(durable=True):
        reservation = _locked(reservation_id, tenant_ids, fence)
        if reservation.state in {State.SETTLED, State.REJECTED, State.RECONCILING, State.PROPOSED}:
            raise _refuse(reservation, "renew the lease of")
        # The database clock, read with the lock (``locks.lock_reservation``): no statement of its own.
        db_now: datetime = reservation.db_now  # type: ignore[attr-defined]
        reservation.lease_expires_at = db_now + timedelta(seconds=settings.LEASE_SECONDS)
        reservation.save(update_fields=["lease_expires_at", "updated_at"])
        return reservation


def record_outcome(
    *, reservation_id: uuid.UUID, tenant_ids: Iterable[int], task_success: bool, cited_evidence_ids: list[str]
) -> Reservation:
    """Store the caller's quality report for the metrics (success, evidence cited)."""
    with transaction.atomic(durable=True):
        reservation = locks.lock_reservation(reservation_id, tenant_ids)
        if reservation is None:
            raise NotFound("no such reservation")
        if reservation.state in {State.PROPOSED, State.REJECTED}:
            raise _refuse(reservation, "report an outcome for")
        reservation.task_success = task_success
        reservation.cited_evidence_ids = cited_evidence_ids
        reservation.save(update_fields=["task_success", "cited_evidence_ids", "updated_at"])
        return reservation
