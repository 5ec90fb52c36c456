"""The one place balances move: conditional updates of held accounts, each with its ledger entries."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime

from django.db import connection
from django.db.models import F, Sum
from django.db.models.sql import InsertQuery

from ledger import locks
from ledger.errors import (
    UsageEventConflict,
)
from ledger.models import (
    CapacityAccount,
    EntryKind,
    Hold,
    LedgerEntry,
    Reservation,
    UsageEvent,
)

logger = logging.getLogger(__name__)


def apply(
    reservation: Reservation,
    account_ids: Sequence[int],
    kind: str,
    *,
    reason: str = "",
    input_reserved: int = 0,
    output_reserved: int = 0,
    input_consumed: int = 0,
    output_consumed: int = 0,
    in_flight: int = 0,
) -> None:
    """Move balances on every held account (ascending pk) and write one entry per account.

    A decrease of consumed tokens (a refund or a downward correction) is limited, per account, to what this
    reservation posted into the account's current period: the rest was consumed in a period that has since
    been closed by a roll-over, stays there, and is not taken from the new period (which must not go
    negative). The entry records what was applied and says when part of the decrease stayed behind.
    """
    if not any((input_reserved, output_reserved, input_consumed, output_consumed, in_flight)):
        return
    # Locked (ascending, after the reservation row): a roll-over cannot slip between this read and the update.
    periods = locks.lock_account_periods(account_ids)
    posted: dict[int, tuple[int, int]] = {}
    if input_consumed < 0 or output_consumed < 0:
        for row in (
            LedgerEntry.objects.filter(reservation=reservation, account_id__in=account_ids)
            .values("account_id", "period_start")
            .annotate(i=Sum("input_consumed"), o=Sum("output_consumed"))
        ):
            if row["period_start"] == periods[row["account_id"]]:
                posted[row["account_id"]] = (row["i"] or 0, row["o"] or 0)
    entries = []
    for account_id in sorted(account_ids):
        in_consumed, out_consumed = input_consumed, output_consumed
        if input_consumed < 0:
            in_consumed = max(input_consumed, -posted.get(account_id, (0, 0))[0])
        if output_consumed < 0:
            out_consumed = max(output_consumed, -posted.get(account_id, (0, 0))[1])
        if not any((input_reserved, output_reserved, in_consumed, out_consumed, in_flight)):
            continue
        CapacityAccount.objects.filter(pk=account_id).update(
            input_reserved=F("input_reserved") + input_reserved,
            output_reserved=F("output_reserved") + output_reserved,
            input_consumed=F("input_consumed") + in_consumed,
            output_consumed=F("output_consumed") + out_consumed,
            in_flight=F("in_flight") + in_flight,
        )
        closed = (in_consumed, out_consumed) != (input_consumed, output_consumed)
        note = " (part of the decrease belongs to a closed period)" if closed else ""
        entries.append(
            LedgerEntry(
                account_id=account_id,
                reservation=reservation,
                kind=kind,
                input_reserved=input_reserved,
                output_reserved=output_reserved,
                input_consumed=in_consumed,
                output_consumed=out_consumed,
                in_flight=in_flight,
                period_start=periods[account_id],
                reason=(reason + note)[:300],
            )
        )
    LedgerEntry.objects.bulk_create(entries)


def held_account_ids(reservation: Reservation) -> list[int]:
    return sorted(Hold.objects.filter(reservation=reservation).values_list("account_id", flat=True))


def write_entries(
    reservation: Reservation, accounts: Iterable[CapacityAccount], kind: str, **deltas: int
) -> None:
    LedgerEntry.objects.bulk_create(
        LedgerEntry(account=a, reservation=reservation, kind=kind, period_start=a.period_start, **deltas)
        for a in accounts
    )


def capture(
    reservation: Reservation,
    account_ids: list[int],
    *,
    usage_event_id: str,
    output_tokens: int,
    input_tokens: int | None,
    final: bool,
) -> UsageEvent:
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
    event = UsageEvent.objects.create(
        reservation=reservation,
        usage_event_id=usage_event_id,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        final=final,
        captured=take,
        overrun=over,
    )
    reservation.captured += take
    reservation.remaining -= take
    reservation.overrun += over
    apply(
        reservation,
        account_ids,
        EntryKind.POST,
        output_reserved=-take,
        output_consumed=output_tokens,
        reason=f"usage {usage_event_id}" + (f" (overrun {over})" if over else ""),
    )
    if input_tokens is not None and input_tokens != reservation.input_consumed:
        # The provider's own count of the input is authoritative for billing: correct what dispatch posted.
        delta = input_tokens - reservation.input_consumed
        reservation.input_consumed = input_tokens
        apply(
            reservation,
            account_ids,
            EntryKind.CORRECTION,
            input_consumed=delta,
            reason=f"provider counted {input_tokens} input tokens",
        )
    if input_tokens is not None:
        reservation.input_reported = input_tokens
    return event


def settle(
    reservation: Reservation,
    transition: Callable[[], None],
    account_ids: list[int],
    *,
    reason: str,
    now: datetime,
    release_input: int = 0,
    refund_input: int = 0,
) -> None:
    """Apply a settling transition (it moves ``remaining`` to ``released``), then release that output
    hold, the concurrency slot and any unposted input hold on every account; refund input when proven
    unprocessed."""
    remaining = reservation.remaining
    transition()
    slot = -1 if reservation.concurrency_held else 0
    reservation.concurrency_held = False
    reservation.settled_at = now
    apply(
        reservation,
        account_ids,
        EntryKind.RELEASE,
        output_reserved=-remaining,
        in_flight=slot,
        input_reserved=-release_input,
        reason=reason,
    )
    if refund_input:
        apply(
            reservation,
            account_ids,
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
) -> LedgerEntry:
    """Move an account's consumed balances outside any reservation (a roll-over, a person's correction) and
    write its entry. The caller holds the account's row lock (``locks.lock_account``)."""
    CapacityAccount.objects.filter(pk=account.pk).update(
        input_consumed=F("input_consumed") + input_consumed,
        output_consumed=F("output_consumed") + output_consumed,
    )
    return LedgerEntry.objects.create(
        account=account,
        kind=kind,
        input_consumed=input_consumed,
        output_consumed=output_consumed,
        period_start=period_start,
        reason=reason[:300],
        created_by=created_by,
    )


# The conditional hold: a limit is respected when the balance after the hold stays within it (Read Committed
# re-checks the WHERE clause on the latest row version, so two holds never both pass on stale balances).
_WITHIN_LIMITS = """
    (a.input_limit IS NULL OR %(i)s = 0 OR a.input_reserved + a.input_consumed + %(i)s <= a.input_limit)
    AND (a.output_limit IS NULL OR %(o)s = 0
         OR a.output_reserved + a.output_consumed + %(o)s <= a.output_limit)
    AND (a.concurrency_limit IS NULL OR a.in_flight + 1 <= a.concurrency_limit)
"""


def hold_new_reservation(reservation: Reservation, account_ids: Sequence[int]) -> set[int]:
    """Insert a new reservation and hold its input, output and one concurrency slot on every account, each
    conditional on the account's limits, with its holds and one HOLD entry per account: ONE statement.

    Returns the accounts that were held; when one is missing the caller must roll the transaction back (the
    others were held). Accounts are locked in ascending id order (the canonical order); the reservation row is
    new, so nothing else can be waiting on it. Raises IntegrityError for an Idempotency-Key already used.
    """
    insert = InsertQuery(Reservation)
    insert.insert_values(list(Reservation._meta.concrete_fields), [reservation])
    ((insert_sql, insert_params),) = insert.get_compiler(connection=connection).as_sql()
    amounts = {"i": reservation.input_reserved, "o": reservation.output_reserved, "rid": reservation.pk}
    cte = (
        """
        , ordered AS (SELECT id FROM ledger_capacityaccount WHERE id = ANY(%(ids)s) ORDER BY id FOR UPDATE)
        , held AS (
            UPDATE ledger_capacityaccount AS a
               SET input_reserved = a.input_reserved + %(i)s,
                   output_reserved = a.output_reserved + %(o)s,
                   in_flight = a.in_flight + 1
              FROM ordered
             WHERE a.id = ordered.id AND """
        + _WITHIN_LIMITS
        + """
            RETURNING a.id, a.period_start)
        , holds AS (INSERT INTO ledger_hold (reservation_id, account_id) SELECT %(rid)s, id FROM held)
        , entries AS (
            INSERT INTO ledger_ledgerentry (account_id, reservation_id, kind, input_reserved, output_reserved,
                input_consumed, output_consumed, in_flight, period_start, reason, created_by, created_at)
            SELECT id, %(rid)s, 'HOLD', %(i)s, %(o)s, 0, 0, 1, period_start, '', '', now() FROM held)
        SELECT COALESCE(array_agg(id), '{}') FROM held
        """
    )
    # The reservation's INSERT comes from Django's compiler (positional %s); the rest is bound by name, so
    # both are rendered to positional parameters here.
    named_sql, named_params = _positional(cte, {**amounts, "ids": sorted(account_ids)})
    with connection.cursor() as cursor:
        cursor.execute(f"WITH new_reservation AS ({insert_sql}){named_sql}", [*insert_params, *named_params])
        (held,) = cursor.fetchone()
    return set(held)


def _positional(sql: str, params: dict[str, object]) -> tuple[str, list[object]]:
    """``%(name)s`` placeholders to ``%s`` with the values in order (a name may repeat)."""
    values: list[object] = []

    def take(match: re.Match[str]) -> str:
        values.append(params[match.group(1)])
        return "%s"

    return re.sub(r"%\((\w+)\)s", take, sql), values
