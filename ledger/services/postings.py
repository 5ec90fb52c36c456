"""The ledger's moves: a reservation's holds, the balance moves of a use case with their entries, usage
captures, settling, and moves outside any reservation. Every hand-written statement they run is in
``ledger/statements.py``; nothing else moves a balance."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db import models, transaction
from django.db.models import F

from budgeting.catalog.prices import cost
from budgeting.db.cursor import this_connection
from budgeting.db.rows import RecordInsert, insert_sql, update_sql, written
from ledger import statements
from ledger.errors import UsageEventConflict
from ledger.models import (
    CapacityAccount,
    EntryKind,
    Hold,
    LedgerEntry,
    Reservation,
    State,
    UsageEvent,
)

logger = logging.getLogger(__name__)


@dataclass
class _Move:
    kind: str
    reason: str
    # One amount per balance of ``ledger.models.BALANCES`` (tokens, concurrency, then money), on every account
    amounts: tuple[int, int, int, int, int, int, int]


@dataclass
class Postings:
    """The balance moves (with their entries), new rows and reservation update of one use case, written
    together by ``flush`` in ONE statement (``statements.move_balances``): the accounts are locked in
    ascending order inside it.

    A move applies the same deltas to every held account. A decrease of consumed tokens or money (a refund
    or a downward correction) is limited, per account, to what this reservation posted into the account's
    current period: the rest was consumed in a period since closed by a roll-over, stays there, and is not
    taken from the new period (which must not go negative); the statement itself caps it (the posted sums are
    read in it, under the accounts' locks), and the entry says when part of the decrease stayed behind.

    Money follows the tokens: before the statement is written (and before a settlement releases the rest),
    the reservation's posted spend is brought to what its tokens cost at the prices frozen on it
    (``_post_spend``), out of its money hold.
    """

    reservation: Reservation
    account_ids: list[int]
    moves: list[_Move] = field(default_factory=list)
    inserts: list[models.Model] = field(default_factory=list)
    unchanged_since: str | None = None
    """The reservation's row version when it was read without a lock: the one write ``flush`` makes applies
    only to that version (RowChanged otherwise)."""

    def move(
        self,
        kind: str,
        *,
        reason: str = "",
        input_reserved: int = 0,
        output_reserved: int = 0,
        input_consumed: int = 0,
        output_consumed: int = 0,
        in_flight: int = 0,
        spend_reserved: int = 0,
        spend_consumed: int = 0,
    ) -> None:
        amounts = (
            input_reserved,
            output_reserved,
            input_consumed,
            output_consumed,
            in_flight,
            spend_reserved,
            spend_consumed,
        )
        if any(amounts):
            self.moves.append(_Move(kind, reason[:300], amounts))

    def add_spend(self, kind: str, *, spend_reserved: int, spend_consumed: int, reason: str) -> None:
        """Money moved by the tokens of the last move: written in that move's entries when it is of the same
        kind (one entry says what the tokens and their money did), else as a move of its own."""
        last = self.moves[-1] if self.moves else None
        if last is not None and last.kind == kind:
            ir, orr, ic, oc, fl, sr, sc = last.amounts
            last.amounts = (ir, orr, ic, oc, fl, sr + spend_reserved, sc + spend_consumed)
            return
        self.move(kind, spend_reserved=spend_reserved, spend_consumed=spend_consumed, reason=reason)

    def insert(self, row: models.Model) -> None:
        """A new row written by the same statement (a usage event, a top-up)."""
        self.inserts.append(row)

    def flush(self, *, within_limits: bool = False) -> set[int]:
        """Write the reservation's row and everything pending in one statement; return the accounts whose
        balances moved. With ``within_limits`` a move is applied only where every limit still holds after it;
        the caller rolls the transaction back when an account is missing."""
        _post_spend(self)
        writes = [update_sql(self.reservation), *(insert_sql(row) for row in self.inserts)]
        moves = [
            (order, account_id, move.kind, move.reason, *move.amounts)
            for order, move in enumerate(self.moves)
            for account_id in sorted(self.account_ids)
        ]
        self.moves, self.inserts = [], []
        moved = statements.move_balances(
            writes,
            moves,
            self.reservation.pk,
            checked=within_limits,
            currency=self.reservation.currency,
            unchanged_since=self.unchanged_since,
        )
        written(self.reservation)
        return moved


def held_account_ids(reservation: Reservation) -> list[int]:
    """The accounts a reservation holds on, ascending (read with its lock when ``locks`` annotated them)."""
    held = getattr(reservation, "held_account_ids", None)
    if held is not None:
        return sorted(held)
    return sorted(Hold.objects.filter(reservation=reservation).values_list("account_id", flat=True))


def capture(
    posts: Postings,
    *,
    usage_event_id: str,
    output_tokens: int,
    input_tokens: int | None,
    final: bool,
    cached_input_tokens: int | None = None,
) -> UsageEvent:
    """Capture one usage delta (the event row is written with the postings). ``cached_input_tokens``, the
    part of the input the provider read from its cache, prices that part at the cached-input price."""
    reservation = posts.reservation
    if cached_input_tokens is not None:
        reservation.input_cached = cached_input_tokens
    if (
        input_tokens is not None
        and reservation.input_reported is not None
        and (input_tokens != reservation.input_reported)
    ):
        # The provider counts the input once; a second, different figure would move money backwards (an
        # input of 0 would refund everything), so it is refused rather than trusted.
        raise UsageEventConflict(
            f"inputTokens {input_tokens} differs from the {reservation.input_reported} already reported",
            code="INPUT_ALREADY_REPORTED",
            recorded={"inputTokens": reservation.input_reported},
        )
    take = min(output_tokens, reservation.remaining)
    over = output_tokens - take
    event = UsageEvent(
        reservation=reservation,
        usage_event_id=usage_event_id,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        final=final,
        captured=take,
        overrun=over,
    )
    posts.insert(event)
    reservation.captured += take
    reservation.remaining -= take
    reservation.overrun += over
    posts.move(
        EntryKind.POST,
        output_reserved=-take,
        output_consumed=output_tokens,
        reason=f"usage {usage_event_id}" + (f" (overrun {over})" if over else ""),
    )
    if input_tokens is not None and input_tokens != reservation.input_consumed:
        # The provider's own count of the input is authoritative for billing: correct what dispatch posted.
        delta = input_tokens - reservation.input_consumed
        reservation.input_consumed = input_tokens
        posts.move(
            EntryKind.CORRECTION,
            input_consumed=delta,
            reason=f"provider counted {input_tokens} input tokens",
        )
    if input_tokens is not None:
        reservation.input_reported = input_tokens
    return event


def settle(
    posts: Postings,
    transition: Callable[[], None],
    *,
    reason: str,
    now: datetime,
    release_input: int = 0,
    refund_input: int = 0,
) -> None:
    """Apply a settling transition (it moves ``remaining`` to ``released``), then release that output
    hold, the concurrency slot, the money still held and any unposted input hold on every account; refund
    input (and its money) when proven unprocessed."""
    reservation = posts.reservation
    _post_spend(posts)
    remaining, money_left = reservation.remaining, reservation.spend_remaining
    transition()
    slot = -1 if reservation.concurrency_held else 0
    reservation.concurrency_held = False
    reservation.settled_at = now
    posts.move(
        EntryKind.RELEASE,
        output_reserved=-remaining,
        in_flight=slot,
        input_reserved=-release_input,
        spend_reserved=-money_left,
        reason=reason,
    )
    if refund_input:
        posts.move(
            EntryKind.CORRECTION,
            input_consumed=-refund_input,
            reason="provider never processed the request: input refunded",
        )


def post_to_account(
    account: CapacityAccount,
    kind: str,
    *,
    period_start: datetime,
    reason: str,
    created_by: str = "",
    input_consumed: int = 0,
    output_consumed: int = 0,
    spend_consumed: int = 0,
) -> LedgerEntry:
    """Move an account's consumed balances outside any reservation (a roll-over, a person's correction) and
    write its entry. The caller holds the account's row lock (``locks.lock_account``)."""
    CapacityAccount.objects.filter(pk=account.pk).update(
        input_consumed=F("input_consumed") + input_consumed,
        output_consumed=F("output_consumed") + output_consumed,
        spend_consumed=F("spend_consumed") + spend_consumed,
    )
    return LedgerEntry.objects.create(
        account=account,
        kind=kind,
        input_consumed=input_consumed,
        output_consumed=output_consumed,
        spend_consumed=spend_consumed,
        period_start=period_start,
        reason=reason[:300],
        created_by=created_by,
    )


def hold_amounts(reservation: Reservation) -> dict[str, int]:
    """What a reservation's hold adds to each account (balance column -> amount): its input, its output, its
    money (on the accounts of its currency) and one concurrency slot. A reservation already DISPATCHED (its
    admission recorded the dispatch) posts its input, and the input's money, as consumed instead of holding
    them."""
    dispatched = reservation.state == State.DISPATCHED
    return {
        "input_reserved": 0 if dispatched else reservation.input_reserved,
        "input_consumed": reservation.input_consumed if dispatched else 0,
        "output_reserved": reservation.output_reserved,
        "in_flight": 1,
        "spend_reserved": reservation.spend_remaining,
        "spend_consumed": reservation.spend_captured,
    }


def _post_admission_spend(reservation: Reservation) -> None:
    """A reservation dispatched by its admission: its input's money is posted with its input, out of the
    money hold, by the reserving statement."""
    if reservation.state == State.DISPATCHED:
        reservation.spend_captured = min(reservation.consumed_cost(), reservation.spend_remaining)
        reservation.spend_remaining -= reservation.spend_captured


def top_up_cost(reservation: Reservation, output_tokens: int) -> int:
    """The money a top-up of ``output_tokens`` holds: the output hold's cost after it, less before it."""
    if not reservation.currency:
        return 0
    held = reservation.output_reserved + reservation.top_ups
    price = reservation.output_price
    return cost(held + output_tokens, price) - cost(held, price)


def hold_top_up(reservation: Reservation, output_tokens: int) -> int:
    """Add a top-up to the reservation's output and money holds; returns the money it holds."""
    money = top_up_cost(reservation, output_tokens)
    reservation.top_ups += output_tokens
    reservation.remaining += output_tokens
    reservation.spend_reserved += money
    reservation.spend_remaining += money
    return money


def _post_spend(posts: Postings) -> None:
    """Bring the money posted for the reservation to what its consumed tokens cost: an increase is taken
    from its money hold (beyond it, an overrun), a decrease (refund, downward correction) comes off the
    overrun first, then what was captured, which is held again (released once settled)."""
    reservation = posts.reservation
    delta = reservation.consumed_cost() - reservation.spend_captured - reservation.spend_overrun
    if delta > 0:
        take = min(delta, reservation.spend_remaining)
        reservation.spend_captured += take
        reservation.spend_remaining -= take
        reservation.spend_overrun += delta - take
        posts.add_spend(EntryKind.POST, spend_reserved=-take, spend_consumed=delta, reason="spend posted")
    elif delta < 0:
        from_overrun = min(-delta, reservation.spend_overrun)
        from_captured = -delta - from_overrun
        reservation.spend_overrun -= from_overrun
        reservation.spend_captured -= from_captured
        # As tokens taken back go back to ``remaining`` while the call may still use them: money held again
        # until settlement, released once it is settled.
        back = from_captured if reservation.settled_at is None else 0
        reservation.spend_remaining += back
        reservation.spend_released += from_captured - back
        posts.add_spend(
            EntryKind.CORRECTION, spend_reserved=back, spend_consumed=delta, reason="spend corrected"
        )


def hold_new_reservation(
    reservation: Reservation,
    account_ids: Sequence[int],
    record: RecordInsert | None = None,
    *,
    catalog_version: int | None = None,
) -> int | None:
    """Insert a new reservation and hold on every account (``statements.hold``): ONE statement, a transaction
    of its own (no BEGIN and COMMIT round trips). With ``record``, the same statement inserts the caller's
    record first and the reservation references it; returns the record's id.

    Raises HoldRefused (nothing written) when an account's limits refuse, IntegrityError for an
    Idempotency-Key (or a providerRequestId of the tenant) already used, CatalogUnchecked (nothing written)
    when the catalog is not at ``catalog_version`` (``statements.hold``). The reservation row is new, so
    nothing else can be waiting on it.
    """
    _post_admission_spend(reservation)
    if record is None:
        row = insert_sql(reservation)
    else:
        row = insert_sql(reservation, {"manifest_id": "(SELECT id FROM record)"})
    with own_transaction():
        return statements.hold(
            row,
            reservation.pk,
            account_ids,
            hold_amounts(reservation),
            None if record is None else (record.sql, record.params),
            reason="dispatched at admission" if reservation.state == State.DISPATCHED else "",
            currency=reservation.currency,
            catalog_version=catalog_version,
        )


def hold_queued_reservation(reservation: Reservation, account_ids: Sequence[int]) -> None:
    """Save a queued reservation being admitted (the caller locked its row and applied the transition) and
    hold on every account: the same statement, and so the same hold, as a new reservation's.

    Raises HoldRefused when an account's limits refuse: nothing was written and the caller's transaction is
    aborted (it must roll back).
    """
    sql, params = update_sql(reservation)
    statements.hold(
        (sql, params), reservation.pk, account_ids, hold_amounts(reservation), currency=reservation.currency
    )
    written(reservation)


def own_transaction() -> contextlib.AbstractContextManager[Any]:
    """Nothing in autocommit mode: the statement commits itself. Inside a transaction,
    ``atomic(durable=True)``: it refuses to join a caller's transaction, as every ledger use case does, and
    within a test's transaction (where Django lifts that check) a savepoint undoes a refused statement."""
    in_transaction = this_connection().in_atomic_block
    return transaction.atomic(durable=True) if in_transaction else contextlib.nullcontext()
