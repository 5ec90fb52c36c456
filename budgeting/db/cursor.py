"""Below every room: the cursor for statements on the hot path, the database clock, and what SQLSTATE a failed
statement answered."""

from __future__ import annotations

import functools
from datetime import datetime
from typing import Any

import psycopg
from django.db import DEFAULT_DB_ALIAS, connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.utils import CursorDebugWrapper, CursorWrapper


class _PreparingCursor(psycopg.RawCursor[Any]):
    """Binds its parameters on the server, takes the statement's text as PostgreSQL's own ($1, $2, …) and
    prepares its statements on the connection."""

    def execute(
        self, query: Any, params: Any = None, *, prepare: bool | None = None, binary: bool | None = None
    ) -> Any:
        return super().execute(_numbered(query), params, prepare=True, binary=binary)


@functools.lru_cache(maxsize=64)
def _numbered(sql: str) -> str:
    """``sql`` with its ``%s`` placeholders numbered as PostgreSQL's ($1, $2, …). psycopg would find them
    itself on every call for a statement as long as the reserving one (it caches the result only for
    statements under 4 KB and 50 parameters; measured: bench/README.md)."""
    parts = sql.split("%s")
    if any("%" in part for part in parts):
        raise ValueError("only %s placeholders can be numbered")
    return "".join(f"{part}${n}" for n, part in enumerate(parts[:-1], start=1)) + parts[-1]


def prepared_cursor() -> CursorWrapper:
    """A cursor for the hot path's statements, whose text is the same on every call.

    Django binds parameters on the client: a large value (an admission's request and answer) is escaped
    into the statement's text and lexed back by the server, and the statement is parsed and planned every
    time. This cursor sends the parameters apart (bytes in binary) and prepares the statement once per
    connection (DATABASE_URL's ``?prepare_threshold=none`` turns preparing off, for a pooler in transaction
    mode). It goes through Django's cursor wrapper, so statement counts and execute wrappers see it as any
    other statement. Used for the reserving statement and the catalog version read of every API request
    (measured: bench/README.md).
    """
    db = this_connection()
    db.ensure_connection()
    db.validate_thread_sharing()
    return (CursorDebugWrapper if db.queries_logged else CursorWrapper)(_Kept(db), db)


def this_connection() -> BaseDatabaseWrapper:
    """This thread's default connection itself. ``django.db.connection`` is a proxy that looks the thread's
    connection up again on every attribute read (through asgiref's Local), a cost measured in
    bench/README.md."""
    return connections[DEFAULT_DB_ALIAS]


# The hot path runs a few dozen statements through this cursor (the admission's, and each lifecycle call's
# shapes: its reservation UPDATE's changed columns, its number of moves); more would mean texts that vary.
_MAX_KEPT = 64


class _Kept:
    """Runs each statement on a cursor kept open for that statement on this connection: psycopg keeps a
    cursor's adapters (which dumper for each parameter's type, which loader for each column) while it runs
    the same statement again, where a new cursor looked them all up again (the reserving statement has ~65
    parameters). Reading goes to the cursor of the last statement run."""

    def __init__(self, db: BaseDatabaseWrapper) -> None:
        self._db = db
        self._cursor: _PreparingCursor | None = None

    def execute(self, query: str, params: Any = None) -> Any:
        self._cursor = _kept_cursor(self._db, _numbered(query))
        done = self._cursor.execute(query, params)
        # The connection answered: Django's health check (CONN_HEALTH_CHECKS) need not ask it again in this
        # request, as it would before the request's first statement through its own cursors.
        self._db.health_check_done = True  # type: ignore[attr-defined]  # not in django-stubs
        return done

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cursor, name)

    def close(self) -> None:
        """The kept cursors stay open with their connection."""


def _kept_cursor(db: BaseDatabaseWrapper, query: str) -> _PreparingCursor:
    raw = db.connection
    kept: dict[str, _PreparingCursor] | None = getattr(db, "_kept_cursors", None)
    if kept is None or getattr(db, "_kept_cursors_of", None) is not raw:
        kept = {}
        db._kept_cursors, db._kept_cursors_of = kept, raw  # type: ignore[attr-defined]
    cursor = kept.pop(query, None)
    if cursor is None or cursor.closed:
        if len(kept) >= _MAX_KEPT:
            # The least recently used goes (the dict keeps use order: a cursor is put back last on each use).
            kept.pop(next(iter(kept))).close()
        cursor = _PreparingCursor(raw)
    kept[query] = cursor
    return cursor


def db_now() -> datetime:
    """The database clock: leases, fences and deadlines never trust an application server's clock."""
    with this_connection().cursor() as cursor:
        cursor.execute("SELECT clock_timestamp()")
        now: datetime = cursor.fetchone()[0]
    return now


def sqlstate_of(error: BaseException) -> str | None:
    """The SQLSTATE of the database error behind a Django database error, if any."""
    return getattr(getattr(error, "__cause__", None), "sqlstate", None)
