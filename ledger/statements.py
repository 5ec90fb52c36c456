"""Every hand-written statement on the capacity accounts, holds and ledger entries, and the one limits
predicate every statement that checks limits uses. ``ledger/services/postings.py`` runs them (``locks`` may
too); no other module imports this one (an import-linter contract), and ``tests/test_boundaries.py`` checks
that no other file writes ``UPDATE ledger_capacityaccount`` or ``INSERT INTO ledger_ledgerentry``.

Two statements move balances, both locking the accounts in ascending id order (the canonical order of
``ledger/locks.py``) inside themselves:
  - ``hold``: a reservation's holds (a new one's INSERT, or a queued one's UPDATE, then the conditional update
    of every account, the holds and one HOLD entry per account): the ONE shape of a hold;
  - ``move_balances``: a use case's moves with their entries, the reservation's UPDATE and new rows (the
    reservation's row locked by the use case, or its UPDATE conditional on the row version the use case read,
    run before the accounts are locked); a decrease of a consumed balance (a refund, a downward correction) is
    capped inside it at what the reservation posted into each account's current period.

Money (``MONEY_BALANCES``) moves only on the accounts kept in the reservation's currency: each statement
scales a row's money by ``money``, 1 on such an account and 0 elsewhere, before it adds, checks or records
it; and a hold is refused by an account with a spend limit in another currency (or when the reservation has
no price): no call is admitted free against a money limit.

The limits predicate (``within_limits``): after adding a delta row's balances to an account row, every limit
of ``ledger.models.LIMITS`` holds, or the delta does not increase that limit's used sum (a release is never
refused). Read Committed re-checks the WHERE clause on the latest row version, so two holds never both pass
on stale balances. ``Limit.refuses`` is the same predicate in Python.

Adding a dimension (a spend limit in money, say):
  1. the columns, in one migration: the account's limit (NULL: unlimited) and its balances
     (``spend_reserved``, ``spend_consumed``) on ``CapacityAccount``, the same balances on ``LedgerEntry``;
  2. the balances in ``ledger.models.BALANCES`` (a consumed one, which a roll-over zeroes, in
     ``CONSUMED_BALANCES`` too) and one ``Limit("spend", "spend_limit", (...))`` in ``ledger.models.LIMITS``:
     every statement here then adds, sums, checks and records them (the hold's delta row, the moves' VALUES,
     the entries, the cap of a decrease), and ``accounts.shortage`` names the dimension;
  3. the amounts: what a hold adds (``postings.hold_amounts``) and the moves that change them
     (``Postings.move``).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from django.db import DatabaseError, connection

from budgeting.catalog.errors import CatalogUnchecked
from budgeting.db.cursor import prepared_cursor, sqlstate_of
from ledger.errors import HoldRefused, RowChanged
from ledger.models import BALANCES, CONSUMED_BALANCES, LIMITS, MONEY_BALANCES, CapacityAccount

# The SQLSTATE of ledger_require_holds (migration ledger 0009): a hold refused by an account's limits.
REFUSED_SQLSTATE = "TB429"
# The SQLSTATE of ledger_require_unchanged (migration ledger 0013): a reservation changed since it was read.
CHANGED_SQLSTATE = "TB409"
# The SQLSTATE of ledger_require_catalog_version (migration ledger 0017): the catalog moved since the caller's
# snapshot was read.
CATALOG_MOVED_SQLSTATE = "TB412"


def _columns(row: str, columns: Sequence[str], between: str = ", ") -> str:
    return between.join(f"{row}.{column}" for column in columns)


def _sum(row: str, columns: Sequence[str]) -> str:
    return _columns(row, columns, " + ")


def within_limits(account: str, delta: str) -> str:
    """THE limits predicate, as SQL: adding the balance columns of the row ``delta`` to the account row
    ``account`` keeps every limit of ``LIMITS``, or does not increase that limit's used sum."""
    return "\n AND ".join(
        f"({account}.{limit.limit} IS NULL OR ({_sum(delta, limit.used)}) <= 0"
        f" OR {_sum(account, limit.used)} + {_sum(delta, limit.used)} <= {account}.{limit.limit})"
        for limit in LIMITS
    )


@functools.cache
def _types() -> dict[str, str]:
    """Each balance column's PostgreSQL type (a statement's parameters are typed: prepared once)."""
    return {column: CapacityAccount._meta.get_field(column).db_type(connection) or "" for column in BALANCES}


_ADD = ", ".join(f"{column} = a.{column} + {{delta}}.{column}" for column in BALANCES)


def _scaled(row: str, factor: str) -> str:
    """The balance columns of ``row`` with its money multiplied by ``factor`` (1 or 0), named as balances."""
    return ", ".join(
        f"{row}.{column} * {factor} AS {column}" if column in MONEY_BALANCES else f"{row}.{column}"
        for column in BALANCES
    )


_ENTRY_COLUMNS = (
    f"account_id, reservation_id, kind, {', '.join(BALANCES)}, period_start, reason, created_by, created_at"
)


@functools.lru_cache(maxsize=8)
def _hold_sql(reservation_sql: str, record_sql: str | None, guarded: bool) -> str:
    types = _types()
    amounts = ", ".join(f"%s::{types[column]} AS {column}" for column in BALANCES)
    record = "" if record_sql is None else f"record AS ({record_sql}), "
    record_id = "NULL::bigint" if record_sql is None else "(SELECT id FROM record)"
    # First in the last step's list: a moved catalog is said before a refused hold.
    guard = "ledger_require_catalog_version(%s::bigint), " if guarded else ""
    # The accounts are locked only once the record and the reservation are written (``ordered`` reads
    # ``reservation``; an unread data-modifying CTE would run after the main query, inside the locks): the
    # hot rows stay locked for the holds, the entries and the commit only, and a replayed Idempotency-Key
    # fails before taking any lock.
    return f"""WITH {record}reservation AS ({reservation_sql} RETURNING id)
    , m AS (SELECT {amounts}, %s::uuid AS rid, %s::text AS reason, %s::text AS currency)
    , ordered AS (
        SELECT id, (currency = (SELECT currency FROM m))::int AS money FROM ledger_capacityaccount
         WHERE id = ANY(%s::bigint[]) AND EXISTS (SELECT FROM reservation)
         ORDER BY id FOR UPDATE)
    , d AS (SELECT ordered.id, {_scaled("m", "ordered.money")} FROM ordered, m)
    , held AS (
        UPDATE ledger_capacityaccount AS a SET {_ADD.format(delta="d")}
          FROM d, m
         WHERE a.id = d.id AND {within_limits("a", "d")}
           AND (a.spend_limit IS NULL OR a.currency = m.currency)
        RETURNING a.id, a.period_start)
    , holds AS (INSERT INTO ledger_hold (reservation_id, account_id) SELECT m.rid, held.id FROM held, m)
    , entries AS (
        INSERT INTO ledger_ledgerentry ({_ENTRY_COLUMNS})
        SELECT held.id, m.rid, 'HOLD', {_columns("d", BALANCES)}, held.period_start, m.reason, '',
               now() FROM held JOIN d ON d.id = held.id, m)
    SELECT {guard}ledger_require_holds(%s::bigint[], COALESCE(array_agg(id), '{{}}')), {record_id}
      FROM held"""


def hold(
    reservation: tuple[str, list[Any]],
    reservation_id: Any,
    account_ids: Sequence[int],
    amounts: Mapping[str, int],
    record: tuple[str, list[Any]] | None = None,
    *,
    reason: str = "",
    currency: str = "",
    catalog_version: int | None = None,
) -> int | None:
    """Write the reservation's row (``reservation``: its INSERT, or its UPDATE when it was queued) and hold
    ``amounts`` (balance column -> amount) on every account, each conditional on ``within_limits``, with its
    holds and one HOLD entry per account (saying ``reason``): ONE statement. The money of ``amounts`` is in
    ``currency`` (empty: the reservation has no price). ``record`` (an INSERT …
    RETURNING id that the reservation's statement reads as ``(SELECT id FROM record)``) is run first;
    returns its id.

    All or nothing: when an account refuses, ``ledger_require_holds`` fails the statement (nothing is
    written; the caller's transaction, if any, is aborted) and HoldRefused names the refusing accounts. With
    ``catalog_version`` (an unchecked caller's: ``Caller.checked_version``), the statement also requires the
    catalog to be at that version (``ledger_require_catalog_version``), and fails with CatalogUnchecked,
    nothing written, when it is not.
    """
    wanted = sorted(account_ids)
    guarded = catalog_version is not None
    statement = _hold_sql(reservation[0], None if record is None else record[0], guarded)
    params = [
        *([] if record is None else record[1]),
        *reservation[1],
        *(amounts.get(column, 0) for column in BALANCES),
        reservation_id,
        reason,
        currency,
        wanted,
        *([catalog_version] if guarded else []),
        wanted,
    ]
    try:
        with prepared_cursor() as cursor:
            cursor.execute(statement, params)
            record_id = cursor.fetchone()[-1]
    except DatabaseError as error:
        if sqlstate_of(error) == CATALOG_MOVED_SQLSTATE:
            raise CatalogUnchecked from None
        refused = _refused_accounts(error)
        if refused is None:
            raise
        raise HoldRefused(refused) from None
    return record_id


def _refused_accounts(error: DatabaseError) -> set[int] | None:
    """The accounts ``ledger_require_holds`` names, or None for any other error."""
    if sqlstate_of(error) != REFUSED_SQLSTATE:
        return None
    cause: Any = error.__cause__
    return {int(part) for part in cause.diag.message_detail.split(",")}


# What an entry's reason says when part of a decrease stayed in a closed period (``_capped_sql``).
CLOSED_PERIOD_NOTE = " (part of the decrease belongs to a closed period)"


def _capped_sql() -> str:
    """The moves ``v`` as ``m``, each decrease of a consumed balance (``CONSUMED_BALANCES``) capped, per
    account, at what the reservation has posted into the account's current period, its earlier moves in the
    statement counted: the rest was consumed in a period a roll-over has closed since, stays there, and is not
    taken from the new period (which must not go negative). The entry of a move capped says so. Money is
    taken as the account takes it (0 outside the reservation's currency; ``s`` and ``ent`` scaling it again
    change nothing).

    Per account and balance, in the moves' order: S is the posted amount plus the moves up to this one, L the
    least of 0 and every S so far; a move applies its amount less the step it makes L take (nothing for a move
    that leaves the running amount at or above 0, so an increase applies in full).

    The accounts are those ``locked`` returns (as they are now, after their lock: their period too); the
    reservation's entries are read in the statement's snapshot, and they are all there: every write of a
    reservation's entries writes its row, which the caller locked before this statement, or which the
    statement's own UPDATE found unchanged since the caller read it (``unchanged_since``). They are read on
    their own first (``entries``, materialized), so by the reservation's index alone: joined to the locked
    accounts, the prepared statement's generic plan on a table without statistics also scanned the account's
    index and read every entry of the account (3 ms at 31,000 entries, growing with the ledger)."""
    running = ", ".join(
        f"COALESCE(p.{column}, 0) + sum(v.{column} * {_unit(column)}) OVER upto AS {column}_s"
        for column in CONSUMED_BALANCES
    )
    applied = ", ".join(
        f"{column} - least(0, min({column}_s) OVER upto)"
        f" + least(0, COALESCE(min({column}_s) OVER before, 0)) AS {column}_applied"
        for column in CONSUMED_BALANCES
    )
    balances = ", ".join(
        f"c.{column}_applied AS {column}" if column in CONSUMED_BALANCES else f"c.{column}"
        for column in BALANCES
    )
    asked = ", ".join(f"c.{column}" for column in CONSUMED_BALANCES)
    got = ", ".join(f"c.{column}_applied" for column in CONSUMED_BALANCES)
    scaled = ", ".join(f"v.{column} * {_unit(column)} AS {column}" for column in BALANCES)
    posted = ", ".join(f"sum(e.{column}) AS {column}" for column in CONSUMED_BALANCES)
    consumed = ", ".join(CONSUMED_BALANCES)
    upto = "PARTITION BY account_id ORDER BY ord ROWS UNBOUNDED PRECEDING"
    return f"""
entries AS MATERIALIZED (
    SELECT account_id, period_start, {consumed} FROM ledger_ledgerentry WHERE reservation_id = %s::uuid),
posted AS (
    SELECT e.account_id, {posted}
      FROM entries AS e JOIN locked AS l ON l.id = e.account_id AND l.period_start = e.period_start
     GROUP BY e.account_id),
run AS (
    SELECT v.ord, v.account_id, v.kind, v.reason, {scaled}, {running}
      FROM v JOIN locked AS l ON l.id = v.account_id LEFT JOIN posted AS p ON p.account_id = v.account_id
    WINDOW upto AS (PARTITION BY v.account_id ORDER BY v.ord ROWS UNBOUNDED PRECEDING)),
c AS (
    SELECT run.*, {applied} FROM run
    WINDOW upto AS ({upto}),
           before AS (PARTITION BY account_id ORDER BY ord ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING)),
m AS (
    SELECT c.ord, c.account_id, c.kind,
           left(c.reason || CASE WHEN ({asked}) <> ({got}) THEN %s ELSE '' END, 300) AS reason, {balances}
      FROM c),"""


def _unit(column: str) -> str:
    """A move's amount of ``column`` as the account takes it: money only in the account's currency."""
    return "l.money" if column in MONEY_BALANCES else "1"


# Where a move row's amounts start (after order, account id, kind and reason), and its consumed balances.
_AMOUNTS = 4
_CONSUMED_AT = [BALANCES.index(column) for column in CONSUMED_BALANCES]


@functools.lru_cache(maxsize=32)
def _moves_sql(rows: int, checked: bool, after_w0: bool, capped: bool) -> str:
    types = _types()
    row = ", ".join(["%s::int", "%s::bigint", "%s", "%s", *(f"%s::{types[c]}" for c in BALANCES)])
    values = ", ".join([f"({row})"] * rows)
    sums = ", ".join(
        f"sum(m.{column}) * l.money AS {column}"
        if column in MONEY_BALANCES
        else f"sum(m.{column}) AS {column}"
        for column in BALANCES
    )
    limits = f"AND {within_limits('a', 's')}" if checked else ""
    nonmoney = [column for column in BALANCES if column not in MONEY_BALANCES]
    money = ", ".join(f"m.{column} * l.money" for column in MONEY_BALANCES)
    zeros = ", ".join(["0"] * len(BALANCES))
    # The moves as given are ``m``; with a decrease, ``v``, and ``m`` is them capped (``_capped_sql``).
    given = "v" if capped else "m"
    # Accounts locked in ascending id order, balances moved by the sum of the moves, one entry per move and
    # account (in the moves' order, so entry ids follow what happened).
    return f"""{given}(ord, account_id, kind, reason, {", ".join(BALANCES)}) AS (VALUES {values}),
locked AS (
    SELECT id, period_start, (currency = %s::text)::int AS money FROM ledger_capacityaccount
     WHERE id IN (SELECT account_id FROM {given}){" AND EXISTS (SELECT FROM w0)" if after_w0 else ""}
     ORDER BY id FOR UPDATE),{_capped_sql() if capped else ""}
s AS (
    SELECT m.account_id, {sums} FROM m JOIN locked AS l ON l.id = m.account_id
     GROUP BY m.account_id, l.money),
upd AS (
    UPDATE ledger_capacityaccount AS a SET {_ADD.format(delta="s")}
      FROM s JOIN locked AS l ON l.id = s.account_id
     WHERE a.id = s.account_id {limits}
    RETURNING a.id),
ent AS (
    INSERT INTO ledger_ledgerentry ({_ENTRY_COLUMNS})
    SELECT m.account_id, %s, m.kind, {_scaled("m", "l.money")}, l.period_start, m.reason,
           '', now()
      FROM m JOIN locked AS l ON l.id = m.account_id
     WHERE ({_columns("m", nonmoney)}, {money}) <> ({zeros})
     ORDER BY m.ord, m.account_id)"""


def move_balances(
    writes: Sequence[tuple[str, list[Any]]],
    moves: Sequence[tuple[Any, ...]],
    reservation_id: Any,
    *,
    checked: bool = False,
    currency: str = "",
    unchanged_since: str | None = None,
) -> set[int]:
    """Run ``writes`` (a reservation's UPDATE, new rows' INSERTs) and ``moves`` — rows of (order, account id,
    kind, reason, one amount per balance of ``BALANCES``) — in ONE statement; returns the accounts whose
    balances moved. With ``checked`` an account moves only where ``within_limits`` holds (the caller rolls
    its transaction back when one is missing). The moves' money is in ``currency``: an entry that would move
    nothing on an account of another currency is not written. A decrease of a consumed balance takes from an
    account no more than the reservation posted into its current period (``_capped_sql``).

    ``unchanged_since`` (the reservation row's version when it was read without a lock, ``writes[0]`` being
    its UPDATE): the UPDATE applies only to that version, it runs before the accounts are locked (the lock
    order of ``ledger/locks.py``), and when it matched nothing ``ledger_require_unchanged`` undoes the whole
    statement: RowChanged. With ``checked`` too (no transaction of the caller's to roll back), an account that
    refuses undoes the whole statement (``ledger_require_holds``): HoldRefused."""
    ctes = [f"w{n} AS ({sql})" for n, (sql, _) in enumerate(writes)]
    params: list[Any] = [value for _, values in writes for value in values]
    guard = "true"
    if unchanged_since is not None:
        ctes[0] = f"w0 AS ({writes[0][0]} AND xmin = %s::text::xid RETURNING 1)"
        params.insert(len(writes[0][1]), unchanged_since)
        guard = "ledger_require_unchanged(EXISTS (SELECT FROM w0))"
    moved = "SELECT 1 WHERE false"
    if moves:
        capped = any(row[_AMOUNTS + i] < 0 for row in moves for i in _CONSUMED_AT)
        ctes.append(_moves_sql(len(moves), checked, unchanged_since is not None, capped))
        params.extend(value for row in moves for value in row)
        params.extend([currency, *([reservation_id, CLOSED_PERIOD_NOTE] if capped else []), reservation_id])
        moved = "SELECT id FROM upd"
    ids = "COALESCE(array_agg(id), '{}')"
    tail: list[Any] = []
    if unchanged_since is not None and checked and moves:
        # CASE: the version is checked first (a changed row is RowChanged, not a refusal).
        ids = f"CASE WHEN {guard} THEN ledger_require_holds(%s::bigint[], {ids}) END"
        guard = "true"
        tail = [sorted({row[1] for row in moves})]
    try:
        with prepared_cursor() as cursor:
            cursor.execute(
                f"WITH {', '.join(ctes)} SELECT {guard}, {ids} FROM ({moved}) AS x(id)", [*params, *tail]
            )
            _, moved_ids = cursor.fetchone()
    except DatabaseError as error:
        if sqlstate_of(error) == CHANGED_SQLSTATE:
            raise RowChanged from None
        refused = _refused_accounts(error)
        if refused is None:
            raise
        raise HoldRefused(refused) from None
    return set(moved_ids)
