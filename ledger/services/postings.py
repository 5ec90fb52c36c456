"""The one place balances move: conditional updates of held accounts, each with its ledger entries."""

from __future__ import annotations

import contextlib
import functools
import logging
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db import DatabaseError, connection, models, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import F, Q, Sum
from django.db.models.sql import UpdateQuery

from budgeting.catalog.prices import cost
from budgeting.db import prepared_cursor, this_connection
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
    State,
    UsageEvent,
)

logger = logging.getLogger(__name__)

# The SQLSTATE of ledger_require_holds: a new reservation's hold refused by an account's limits.
REFUSED_SQLSTATE = "TB429"


@dataclass
class _Move:
    kind: str
    reason: str
    # account id -> (input reserved, output reserved, input consumed, output consumed, in flight,
    # spend reserved, spend consumed); spend moves only on the accounts of the reservation's currency
    deltas: dict[int, tuple[int, int, int, int, int, int, int]]


@dataclass
class Postings:
    """The balance moves (with their entries), new rows and reservation update of one use case, written
    together by ``flush`` in ONE statement: the accounts are locked in ascending order inside it.

    A move applies the same deltas to every held account. A decrease of consumed tokens (a refund or a
    downward correction) is limited, per account, to what this reservation posted into the account's current
    period: the rest was consumed in a period since closed by a roll-over, stays there, and is not taken from
    the new period (which must not go negative); its entry says when part of the decrease stayed behind.

    Money follows the tokens: before the statement is written (and before a settlement releases the rest),
    the reservation's posted spend is brought to what its tokens cost at the prices frozen on it
    (``_post_spend``), out of its money hold.
    """

    reservation: Reservation
    account_ids: list[int]
    moves: list[_Move] = field(default_factory=list)
    inserts: list[models.Model] = field(default_factory=list)

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
        if not any(amounts):
            return
        if input_consumed >= 0 and output_consumed >= 0 and spend_consumed >= 0:
            self.moves.append(_Move(kind, reason[:300], dict.fromkeys(self.account_ids, amounts)))
            return
        # What was posted so far must be written before it can be counted: the rare decrease costs statements.
        self.flush(save=False)
        periods = locks.lock_account_periods(self.account_ids)
        posted: dict[int, tuple[int, int, int]] = {}
        for row in (
            LedgerEntry.objects.filter(reservation=self.reservation, account_id__in=self.account_ids)
            .values("account_id", "period_start")
            .annotate(i=Sum("input_consumed"), o=Sum("output_consumed"), s=Sum("spend_consumed"))
        ):
            if row["period_start"] == periods[row["account_id"]]:
                posted[row["account_id"]] = (row["i"] or 0, row["o"] or 0, row["s"] or 0)
        for account_id in self.account_ids:
            done_in, done_out, done_spend = posted.get(account_id, (0, 0, 0))
            in_consumed = max(input_consumed, -done_in) if input_consumed < 0 else input_consumed
            out_consumed = max(output_consumed, -done_out) if output_consumed < 0 else output_consumed
            sp_consumed = max(spend_consumed, -done_spend) if spend_consumed < 0 else spend_consumed
            applied = (
                input_reserved,
                output_reserved,
                in_consumed,
                out_consumed,
                in_flight,
                spend_reserved,
                sp_consumed,
            )
            if not any(applied):
                continue
            closed = (in_consumed, out_consumed, sp_consumed) != (
                input_consumed,
                output_consumed,
                spend_consumed,
            )
            note = " (part of the decrease belongs to a closed period)" if closed else ""
            self.moves.append(_Move(kind, (reason + note)[:300], {account_id: applied}))

    def add_spend(self, kind: str, *, spend_reserved: int, spend_consumed: int, reason: str) -> None:
        """Money moved by the tokens of the last move: written in that move's entries when it is of the same
        kind and moves every account alike (one entry says what the tokens and their money did), else as a
        move of its own. ``spend_consumed`` is not negative (a decrease goes through ``move``)."""
        last = self.moves[-1] if self.moves else None
        alike = (
            last is not None
            and set(last.deltas) == set(self.account_ids)
            and len(set(last.deltas.values())) == 1
        )
        if last is not None and last.kind == kind and alike:
            for account_id, (ir, orr, ic, oc, fl, sr, sc) in last.deltas.items():
                last.deltas[account_id] = (ir, orr, ic, oc, fl, sr + spend_reserved, sc + spend_consumed)
            return
        self.move(kind, spend_reserved=spend_reserved, spend_consumed=spend_consumed, reason=reason)

    def insert(self, row: models.Model) -> None:
        """A new row written by the same statement (a usage event, a top-up)."""
        self.inserts.append(row)

    def flush(self, *, save: bool = True, within_limits: bool = False) -> set[int]:
        """Write everything pending (and, with ``save``, the reservation's row) in one statement; return the
        accounts whose balances moved. With ``within_limits`` a move is applied only where every limit still
        holds after it; the caller rolls the transaction back when an account is missing."""
        parts: list[tuple[str, list[object]]] = []
        if save:
            _post_spend(self)
            parts.append(_update_sql(self.reservation))
        parts.extend(_insert_sql(row) for row in self.inserts)
        rows = [
            (order, account_id, move.kind, move.reason, *amounts)
            for order, move in enumerate(self.moves)
            for account_id, amounts in sorted(move.deltas.items())
        ]
        self.moves, self.inserts = [], []
        if not parts and not rows:
            return set()
        ctes = [f"w{n} AS ({sql})" for n, (sql, _) in enumerate(parts)]
        params: list[Any] = [value for _, values in parts for value in values]
        moved = "SELECT 1 WHERE false"
        if rows:
            values = ", ".join(
                [
                    "(%s::int, %s::bigint, %s, %s, %s::bigint, %s::bigint, %s::bigint, %s::bigint, %s::int,"
                    " %s::bigint, %s::bigint)"
                ]
                * len(rows)
            )
            ctes.append(f"m(ord, account_id, kind, reason, ir, orr, ic, oc, fl, sr, sc) AS (VALUES {values})")
            params.extend(value for row in rows for value in row)
            ctes.append(_MOVES_SQL.format(limits=_MOVE_WITHIN_LIMITS if within_limits else ""))
            params.extend([self.reservation.currency, self.reservation.pk])
            moved = "SELECT id FROM upd"
        with connection.cursor() as cursor:
            cursor.execute(
                f"WITH {', '.join(ctes)} SELECT COALESCE(array_agg(id), '{{}}') FROM ({moved}) AS x(id)",
                params,
            )
            (ids,) = cursor.fetchone()
        return set(ids)


# The moves of one flush: accounts locked in ascending id order, balances moved by the sum of the moves, one
# entry per move and account (in the moves' order, so entry ids follow what happened).
# Money moves only on the accounts kept in the reservation's currency (``cur``; an unpriced reservation has
# none): ``l.money`` is 1 there, 0 elsewhere; an entry that would move nothing there is not written.
_MOVES_SQL = """
cur AS (SELECT %s::text AS code),
locked AS (
    SELECT id, period_start, (currency = (SELECT code FROM cur))::int AS money FROM ledger_capacityaccount
     WHERE id IN (SELECT account_id FROM m) ORDER BY id FOR UPDATE),
sums AS (
    SELECT account_id, sum(ir) AS ir, sum(orr) AS orr, sum(ic) AS ic, sum(oc) AS oc, sum(fl) AS fl,
           sum(sr) AS sr, sum(sc) AS sc
      FROM m GROUP BY account_id),
upd AS (
    UPDATE ledger_capacityaccount AS a
       SET input_reserved = a.input_reserved + s.ir, output_reserved = a.output_reserved + s.orr,
           input_consumed = a.input_consumed + s.ic, output_consumed = a.output_consumed + s.oc,
           in_flight = a.in_flight + s.fl,
           spend_reserved = a.spend_reserved + s.sr * l.money,
           spend_consumed = a.spend_consumed + s.sc * l.money
      FROM sums AS s JOIN locked AS l ON l.id = s.account_id
     WHERE a.id = s.account_id {limits}
    RETURNING a.id),
ent AS (
    INSERT INTO ledger_ledgerentry (account_id, reservation_id, kind, input_reserved, output_reserved,
        input_consumed, output_consumed, in_flight, spend_reserved, spend_consumed, period_start, reason,
        created_by, created_at)
    SELECT m.account_id, %s, m.kind, m.ir, m.orr, m.ic, m.oc, m.fl, m.sr * l.money, m.sc * l.money,
           l.period_start, m.reason, '', now()
      FROM m JOIN locked AS l ON l.id = m.account_id
     WHERE (m.ir, m.orr, m.ic, m.oc, m.fl, m.sr * l.money, m.sc * l.money) <> (0, 0, 0, 0, 0, 0, 0)
     ORDER BY m.ord, m.account_id)
"""
# A top-up holds more output: every limit must still hold after it (as for a new hold).
_MOVE_WITHIN_LIMITS = """
       AND (a.output_limit IS NULL OR s.orr <= 0
            OR a.output_reserved + a.output_consumed + s.orr <= a.output_limit)
       AND (a.spend_limit IS NULL OR s.sr * l.money <= 0
            OR a.spend_reserved + a.spend_consumed + s.sr <= a.spend_limit)
"""


def _update_sql(reservation: Reservation) -> tuple[str, list[Any]]:
    """The reservation's UPDATE as ``save()`` would run it (auto_now fields included): the fields it loaded
    (a deferred one it never read is left as it is)."""
    deferred = reservation.get_deferred_fields()
    fields = [f for f in Reservation._meta.concrete_fields if not f.primary_key and f.attname not in deferred]
    query = UpdateQuery(Reservation)
    query.add_update_fields([(f, None, f.pre_save(reservation, False)) for f in fields])
    query.add_q(Q(pk=reservation.pk))
    sql, params = query.get_compiler(connection=connection).as_sql()
    return sql, list(params)


def _insert_sql(row: models.Model, expressions: Mapping[str, str] | None = None) -> tuple[str, list[Any]]:
    """The INSERT of ``row`` and its parameters, as Django's compiler writes them (each field's ``pre_save``
    for an insert, then its ``get_db_prep_save``); the statement's text is built once per model and columns,
    which keeps Django's compiler (about half of a service-layer reserve's Python time) off the hot path.
    ``expressions`` gives a column an SQL expression instead of the row's value."""
    model = type(row)
    given = expressions or {}
    db = this_connection()
    columns = [c for c in _columns(model) if not (c.primary_key and getattr(row, c.attname) is None)]
    params = [_db_value(c, row, db) for c in columns if c.name not in given]
    statement = _insert_statement(model, tuple(c.name for c in columns), tuple(sorted(given.items())))
    return statement, params


# Fields whose value, when of one of these exact types, is what Django would send (their ``pre_save`` reads
# the attribute; their ``get_db_prep_save`` gives such a value back unchanged, an integer wrapped in the
# PostgreSQL type of its column). A subclass counts only when it changes none of that (django-fsm's state
# field); a field that sets its own value on save (auto_now, auto_now_add) never does.
_PLAIN_TYPES: dict[type, tuple[type, ...]] = {
    models.CharField: (str, type(None)),
    models.TextField: (str, type(None)),
    models.IntegerField: (int, type(None)),
    models.BigIntegerField: (int, type(None)),
    models.PositiveIntegerField: (int, type(None)),
    models.AutoField: (int, type(None)),
    models.BigAutoField: (int, type(None)),
    models.BooleanField: (bool, type(None)),
    models.UUIDField: (uuid.UUID, type(None)),
    models.DateTimeField: (type(None),),
    models.JSONField: (type(None),),
}
_PREPARATION = ("pre_save", "get_db_prep_save", "get_db_prep_value", "get_prep_value")


@dataclass(frozen=True)
class _Column:
    """A concrete field of a model with what ``_db_value`` needs, worked out once per process."""

    field: models.Field[Any, Any]
    name: str
    attname: str
    primary_key: bool
    plain: tuple[type, ...]
    """The value types that pass through as they are."""
    wrapper: type | None
    """The int subclass Django wraps this column's integers in (so a prepared statement's types are fixed)."""


@functools.lru_cache(maxsize=64)
def _columns(model: type[models.Model]) -> tuple[_Column, ...]:
    return tuple(_column(f) for f in model._meta.concrete_fields)


def _column(field: models.Field[Any, Any]) -> _Column:
    target = field.target_field if isinstance(field, models.ForeignKey) else field
    plain: tuple[type, ...] = ()
    if not (getattr(field, "auto_now", False) or getattr(field, "auto_now_add", False)):
        plain = _passes_through(type(target))
    wrapper = type(field.get_db_prep_save(1, connection)) if int in plain else None
    assert field.column is not None
    return _Column(
        field, field.column, field.attname, field.primary_key, plain, None if wrapper is int else wrapper
    )


def _passes_through(cls: type) -> tuple[type, ...]:
    for base in cls.__mro__:
        if base in _PLAIN_TYPES:
            same = all(getattr(cls, name) is getattr(base, name) for name in _PREPARATION)
            return _PLAIN_TYPES[base] if same else ()
    return ()


def _db_value(column: _Column, row: models.Model, db: BaseDatabaseWrapper) -> Any:
    """``field.get_db_prep_save(field.pre_save(row, True))``, without the calls when they would change
    nothing (most of an admission's ~60 columns): a third of ``_insert_sql``'s time under load."""
    value = getattr(row, column.attname)
    if type(value) in column.plain:
        return value if column.wrapper is None or value is None else column.wrapper(value)
    return column.field.get_db_prep_save(column.field.pre_save(row, True), db)


@functools.lru_cache(maxsize=64)
def _insert_statement(
    model: type[models.Model], columns: tuple[str, ...], expressions: tuple[tuple[str, str], ...]
) -> str:
    if any(hasattr(f, "get_placeholder") for f in model._meta.concrete_fields):
        raise TypeError(f"{model.__name__} has a field with its own placeholder; use Django's compiler")
    quote = connection.ops.quote_name
    given = dict(expressions)
    values = ", ".join(given.get(column, "%s") for column in columns)
    return f"INSERT INTO {quote(model._meta.db_table)} ({', '.join(map(quote, columns))}) VALUES ({values})"


@dataclass(frozen=True)
class RecordInsert:
    """The INSERT of a caller's record of an admission (its manifest), returning the record's id. The
    reserving statement runs it itself (``hold_new_reservation``): no round trip of its own."""

    sql: str
    params: list[Any]

    @classmethod
    def of(cls, row: models.Model) -> RecordInsert:
        sql, params = _insert_sql(row)
        pk = type(row)._meta.pk
        assert pk is not None and pk.column is not None
        return cls(f"{sql} RETURNING {connection.ops.quote_name(pk.column)}", params)

    def run(self) -> int:
        """Run it on its own; returns the new record's id."""
        with connection.cursor() as cursor:
            cursor.execute(self.sql, self.params)
            (record_id,) = cursor.fetchone()
        return int(record_id)


def held_account_ids(reservation: Reservation) -> list[int]:
    """The accounts a reservation holds on, ascending (read with its lock when ``locks`` annotated them)."""
    held = getattr(reservation, "held_account_ids", None)
    if held is not None:
        return sorted(held)
    return sorted(Hold.objects.filter(reservation=reservation).values_list("account_id", flat=True))


def write_entries(
    reservation: Reservation,
    accounts: Iterable[CapacityAccount],
    kind: str,
    spend_reserved: int = 0,
    **deltas: int,
) -> None:
    """One entry per account; the money only on the accounts kept in the reservation's currency."""
    LedgerEntry.objects.bulk_create(
        LedgerEntry(
            account=a,
            reservation=reservation,
            kind=kind,
            period_start=a.period_start,
            spend_reserved=spend_reserved if a.currency == reservation.currency else 0,
            **deltas,
        )
        for a in accounts
    )


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
        posts.move(EntryKind.CORRECTION, spend_reserved=back, spend_consumed=delta, reason="spend corrected")


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


# The conditional hold: a limit is respected when the balance after the hold stays within it (Read Committed
# re-checks the WHERE clause on the latest row version, so two holds never both pass on stale balances).
_WITHIN_LIMITS = """
    (a.input_limit IS NULL OR %(i)s = 0 OR a.input_reserved + a.input_consumed + %(i)s <= a.input_limit)
    AND (a.output_limit IS NULL OR %(o)s = 0
         OR a.output_reserved + a.output_consumed + %(o)s <= a.output_limit)
    AND (a.concurrency_limit IS NULL OR a.in_flight + 1 <= a.concurrency_limit)
    AND (a.spend_limit IS NULL
         OR (a.currency = %(c)s AND a.spend_reserved + a.spend_consumed + %(s)s <= a.spend_limit))
"""


# The holds of a new reservation after its INSERT: the amounts are bound once (``m``). The accounts are locked
# only once the record and the reservation are written (``ordered`` reads ``new_reservation``; an unread
# data-modifying CTE would run after the main query, inside the locks): the hot rows stay locked for the
# holds, the entries and the commit only, and a replayed Idempotency-Key fails before taking any lock.
_HOLD_SQL = (
    """
    , m AS (SELECT %s::bigint AS i, %s::bigint AS o, %s::uuid AS rid, %s::bigint AS c, %s::text AS why,
                   %s::bigint AS s, %s::bigint AS sc, %s::text AS cur)
    , ordered AS (
        SELECT id FROM ledger_capacityaccount
         WHERE id = ANY(%s::bigint[]) AND EXISTS (SELECT FROM new_reservation)
         ORDER BY id FOR UPDATE)
    , held AS (
        UPDATE ledger_capacityaccount AS a
           SET input_reserved = a.input_reserved + m.i,
               input_consumed = a.input_consumed + m.c,
               output_reserved = a.output_reserved + m.o,
               in_flight = a.in_flight + 1,
               spend_reserved = a.spend_reserved + m.s * (a.currency = m.cur)::int,
               spend_consumed = a.spend_consumed + m.sc * (a.currency = m.cur)::int
          FROM ordered, m
         WHERE a.id = ordered.id AND """
    + _WITHIN_LIMITS.replace("%(i)s", "(m.i + m.c)")
    .replace("%(o)s", "m.o")
    .replace("%(s)s", "(m.s + m.sc)")
    .replace("%(c)s", "m.cur")
    + """
        RETURNING a.id, a.period_start, (a.currency = m.cur)::int AS money)
    , holds AS (INSERT INTO ledger_hold (reservation_id, account_id) SELECT m.rid, held.id FROM held, m)
    , entries AS (
        INSERT INTO ledger_ledgerentry (account_id, reservation_id, kind, input_reserved, output_reserved,
            input_consumed, output_consumed, in_flight, spend_reserved, spend_consumed, period_start, reason,
            created_by, created_at)
        SELECT held.id, m.rid, 'HOLD', m.i, m.o, m.c, 0, 1, m.s * held.money, m.sc * held.money,
               held.period_start, m.why, '', now()
          FROM held, m)
    SELECT ledger_require_holds(%s::bigint[], COALESCE(array_agg(id), '{{}}')), {record_id} FROM held
    """
)


class HoldRefused(Exception):
    """A new reservation's hold was refused by these accounts (their limits): nothing was written."""

    def __init__(self, account_ids: set[int]) -> None:
        super().__init__(sorted(account_ids))
        self.account_ids = account_ids


def hold_new_reservation(
    reservation: Reservation, account_ids: Sequence[int], record: RecordInsert | None = None
) -> int | None:
    """Insert a new reservation and hold its input, output, money (``spend_reserved``, on the accounts kept
    in its currency) and one concurrency slot on every account, each conditional on the account's limits (an
    account with a spend limit refuses a reservation without a price in its currency), with its holds and
    one HOLD entry per account: ONE statement, a transaction of its own (no BEGIN and COMMIT round trips).
    With ``record``, the same statement inserts the caller's record first and the reservation references
    it; returns the record's id.

    All or nothing: when an account refuses the hold, ``ledger_require_holds`` (migration ledger 0009) fails
    the statement, nothing is written, and HoldRefused names the refusing accounts. Accounts are locked in
    ascending id order (the canonical order); the reservation row is new, so nothing else can be waiting on
    it. A reservation already DISPATCHED (its admission recorded the dispatch) posts its input as consumed
    instead of holding it, within the same limits. Raises IntegrityError for an Idempotency-Key (or a
    providerRequestId of the tenant) already used.
    """
    if reservation.state == State.DISPATCHED:
        # Its input's money is posted with the input: out of the money hold, in the same statement.
        reservation.spend_captured = min(reservation.consumed_cost(), reservation.spend_remaining)
        reservation.spend_remaining -= reservation.spend_captured
    if record is None:
        insert_sql, insert_params = _insert_sql(reservation)
        prefix, prefix_params, record_id = "WITH ", [], "NULL::bigint"
    else:
        insert_sql, insert_params = _insert_sql(reservation, {"manifest_id": "(SELECT id FROM record)"})
        prefix, prefix_params, record_id = (
            f"WITH record AS ({record.sql}), ",
            record.params,
            "(SELECT id FROM record)",
        )
    wanted = sorted(account_ids)
    # A reservation dispatched by its admission posts its input as consumed at once (its HOLD entry says so).
    if reservation.state == State.DISPATCHED:
        held_input, posted_input, reason = 0, reservation.input_consumed, "dispatched at admission"
    else:
        held_input, posted_input, reason = reservation.input_reserved, 0, ""
    amounts: list[Any] = [
        held_input,
        reservation.output_reserved,
        reservation.pk,
        posted_input,
        reason,
        reservation.spend_remaining,
        reservation.spend_captured,
        reservation.currency,
        wanted,
    ]
    holds = _HOLD_SQL.format(record_id=record_id)
    statement = f"{prefix}new_reservation AS ({insert_sql} RETURNING id){holds}"
    try:
        with _own_transaction(), prepared_cursor() as cursor:
            cursor.execute(statement, [*prefix_params, *insert_params, *amounts, wanted])
            _, new_record_id = cursor.fetchone()
    except DatabaseError as error:
        refused = _refused_accounts(error)
        if refused is None:
            raise
        raise HoldRefused(refused) from None
    return new_record_id


def _own_transaction() -> contextlib.AbstractContextManager[Any]:
    """Nothing in autocommit mode: the statement commits itself. Inside a transaction,
    ``atomic(durable=True)``: it refuses to join a caller's transaction, as every ledger use case does, and
    within a test's transaction (where Django lifts that check) a savepoint undoes a refused statement."""
    in_transaction = this_connection().in_atomic_block
    return transaction.atomic(durable=True) if in_transaction else contextlib.nullcontext()


def _refused_accounts(error: DatabaseError) -> set[int] | None:
    """The accounts ``ledger_require_holds`` names, or None for any other error."""
    cause: Any = error.__cause__
    if getattr(cause, "sqlstate", None) != REFUSED_SQLSTATE:
        return None
    return {int(part) for part in cause.diag.message_detail.split(",")}
